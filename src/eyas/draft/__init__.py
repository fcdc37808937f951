"""draft stage."""

from typing import Literal

# The TTT attention kernels the draft has (draft/flex.py picks one): eyas train's --attention takes
# them from here (eyas.train.config), so that the draft imports nothing of the trainer
AttentionKind = Literal["auto", "dense", "flex"]
