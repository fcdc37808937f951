"""The target's hidden states: which layers (``layers``), how they are captured from an HF model
(``capture``), and the on-disk store (``format``, ``writer``, ``reader``, ``verify``).

Used by extract (writes stores), train (reads them, or captures online) and evaluate (captures
while the target decodes).
"""
