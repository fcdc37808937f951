"""Render conversations with the target's chat template and mark the tokens the assistant writes.

The mask comes from the template itself, so any model family works without a per-family rule:

* templates with ``{% generation %}`` blocks: the character spans transformers reports for them
  (the same machinery as ``return_assistant_tokens_mask``);
* otherwise, by rendering prefixes: for assistant turn j, ``render(messages[:j],
  add_generation_prompt=True)`` ends where the assistant starts writing, and
  ``render(messages[:j+1])`` ends after its turn. Both are character offsets into the full
  rendering, which must start with every prefix (else the turn is skipped as
  ``template_not_incremental``).

Character spans become token spans through the fast tokenizer's char->token map of ONE batched
encode of the full text (no re-tokenising of prefixes). A span is then cut after its last stop
token (the end-of-turn the model emits), so scaffolding such as the newline that ChatML puts
after ``<|im_end|>`` is not trained on, while the end-of-turn token is.
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from eyas.data.formats import Skip
from eyas.data.loops import loop_start
from eyas.errors import EyasError

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Long conversations are encoded only up to max_length * CHARS_PER_TOKEN + CUT_MARGIN chars;
# kept tokens must end CUT_MARGIN chars before the cut, far beyond any pre-token, so the cut
# cannot change them (else the whole text is encoded).
CHARS_PER_TOKEN = 6
CUT_MARGIN = 2048


class TemplateMaskError(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class Encoded:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # int8 [T]
    truncated: bool  # the rendering was longer than max_length tokens
    loop_tokens: int = 0  # assistant tokens left out of the loss as a loop's repeats (mask_loops)


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()


def stop_token_ids(tokenizer, model_dir=None) -> list[int]:
    """Ids that end an assistant turn: the tokenizer's eos plus generation_config's eos ids."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_dir is not None:
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        except (OSError, ValueError):
            eos = None
        if eos is not None:
            ids.update(int(x) for x in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return sorted(ids)


class ChatEncoder:
    """Template rendering + assistant loss mask for one tokenizer/template pair."""

    def __init__(
        self, tokenizer, chat_template: str | None = None, stop_ids: Iterable[int] | None = None, name: str = "target"
    ):
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default")
        if not template:
            raise EyasError(
                f"{name}: the tokenizer has no chat template, so eyas cannot tell "
                "which tokens the assistant writes; pass --chat-template FILE "
                "(a Jinja template as in tokenizer_config.json)"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise EyasError(
                f"{name}: eyas needs a fast (Rust) tokenizer for character offsets; "
                "this one is a slow Python tokenizer (no tokenizer.json)"
            )
        ids = stop_ids if stop_ids is not None else stop_token_ids(tokenizer)
        self._setup(tokenizer.backend_tokenizer, template, dict(tokenizer.special_tokens_map), ids)

    def _setup(self, backend, template: str, special_tokens: dict, stop_ids: Iterable[int]) -> None:
        self.template = template
        self.template_sha256 = template_sha256(template)
        self.uses_generation_blocks = bool(GENERATION_BLOCK.search(template))
        self.stop_ids = np.array(sorted(set(int(x) for x in stop_ids)), dtype=np.int64)
        self._kwargs = special_tokens
        self._backend = backend
        self._lock = threading.Lock()

    def parts(self) -> tuple[str, str, dict, list[int]]:
        """Picklable state for worker processes (they skip importing AutoTokenizer)."""
        return (self._backend.to_str(), self.template, dict(self._kwargs), [int(x) for x in self.stop_ids])

    @classmethod
    def from_parts(cls, backend_json: str, template: str, special_tokens: dict, stop_ids: list[int]) -> "ChatEncoder":
        from tokenizers import Tokenizer

        self = cls.__new__(cls)
        self._setup(Tokenizer.from_str(backend_json), template, special_tokens, stop_ids)
        return self

    # -------------------------------------------------------------------------- rendering

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        out, _ = render_jinja_template(
            conversations=[messages],
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            **self._kwargs,
        )
        return out[0]

    def assistant_spans(self, messages: list[dict], max_chars: int | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The full rendering and the character span of each assistant turn in it."""
        if self.uses_generation_blocks:
            from transformers.utils.chat_template_utils import render_jinja_template

            with self._lock:  # transformers' generation tracker lives on the shared environment
                out, idx = render_jinja_template(
                    conversations=[messages],
                    chat_template=self.template,
                    return_assistant_tokens_mask=True,
                    **self._kwargs,
                )
            return out[0], [(int(s), int(e)) for s, e in idx[0]]
        full = self.render(messages)
        spans: list[tuple[int, int]] = []
        for j, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            if max_chars is not None and spans and spans[-1][1] >= max_chars:
                break  # later turns start beyond what will be kept
            before = self.render(messages[:j], add_generation_prompt=True)
            upto = self.render(messages[: j + 1])
            if not full.startswith(upto):
                raise TemplateMaskError(
                    "template_not_incremental", f"rendering of turns 0..{j} is not a prefix of the whole conversation"
                )
            start = len(before) if upto.startswith(before) else _common_prefix_len(before, upto)
            spans.append((start, len(upto)))
        return full, spans

    # --------------------------------------------------------------------------- encoding

    def encode(
        self, conversations: list[list[dict]], max_length: int, mask_loops: bool = False
    ) -> list[Encoded | Skip]:
        """Render, batch-encode and mask ``conversations``; one Encoded or Skip per input. With
        ``mask_loops`` an assistant turn that ends in a loop is trained on up to the loop's first
        periods only (:mod:`eyas.data.loops`)."""
        cut = max_length * CHARS_PER_TOKEN + CUT_MARGIN
        rendered: list[tuple[str, list[tuple[int, int]]] | Skip] = []
        for msgs in conversations:
            try:
                rendered.append(self.assistant_spans(msgs, max_chars=cut))
            except TemplateMaskError as e:
                rendered.append(Skip(e.reason, e.detail))
            except Exception as e:  # jinja2 errors, raise_exception() in the template
                rendered.append(Skip("template_error", f"{type(e).__name__}: {str(e)[:200]}"))
        todo = [i for i, r in enumerate(rendered) if not isinstance(r, Skip)]
        encs = self._backend.encode_batch([rendered[i][0][:cut] for i in todo], add_special_tokens=False)
        out: list[Encoded | Skip] = list(rendered)  # Skips stay in place
        for i, enc in zip(todo, encs):
            text, spans = rendered[i]
            limit = min(len(text), cut)
            if len(text) > cut and not (
                len(enc.ids) > max_length and enc.token_to_chars(max_length - 1)[1] <= cut - CUT_MARGIN
            ):
                enc, limit = self._backend.encode(text, add_special_tokens=False), len(text)
            out[i] = self._mask(enc, spans, max_length, limit, mask_loops)
        return out

    def _mask(
        self, enc, spans: list[tuple[int, int]], max_length: int, limit: int, mask_loops: bool = False
    ) -> Encoded:
        all_ids = enc.ids
        n = min(len(all_ids), max_length)
        ids = np.asarray(all_ids[:n], dtype=np.int32)
        mask = np.zeros(n, dtype=np.int8)
        loop_tokens = 0
        for s, e in spans:
            e = min(e, limit)  # limit: characters actually encoded
            if e <= s:
                continue
            t0 = _token_at(enc, s, e, step=1)
            if t0 is None or t0 >= n:
                continue
            t1 = _token_at(enc, e - 1, s - 1, step=-1)
            if t1 is None or t1 < t0:
                continue
            body_end = t1 + 1  # the answer's own tokens end here, before its stop token
            if t1 < n:  # the whole turn is kept: end it at its last stop token
                stops = np.nonzero(np.isin(ids[t0 : t1 + 1], self.stop_ids))[0]
                if stops.size:
                    t1 = t0 + int(stops[-1])
                    body_end = t1
            else:  # cut by max_length inside the turn
                t1, body_end = n - 1, n
            mask[t0 : t1 + 1] = 1
            if mask_loops and (cut := loop_start(ids[t0:body_end])) is not None:
                # an answer ending in a loop was nearly always cut at the cap: its stop token is the template's
                mask[t0 + cut : t1 + 1] = 0
                loop_tokens += t1 + 1 - (t0 + cut)
        return Encoded(ids, mask, truncated=len(all_ids) > max_length, loop_tokens=loop_tokens)


def _token_at(enc, pos: int, stop: int, step: int) -> int | None:
    """Token covering character ``pos``, walking towards ``stop`` past uncovered characters."""
    for p in range(pos, stop, step):
        t = enc.char_to_token(p)
        if t is not None:
            return t
    return None


def _common_prefix_len(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search on C-speed slice comparisons
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
