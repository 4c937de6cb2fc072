"""TRL's `SFTTrainer` with the Needle fine-tuning loss (see `needle_hf.finetune.trainer`).

Use it like `SFTTrainer` on the conversations of `needle_hf.finetune.data.load_finetune_dataset`
with ``SFTConfig(assistant_only_loss=True)``: the chat template's
`{% generation %}` block marks the reference's loss tokens (target and EOS).
"""

from trl import SFTTrainer

from .trainer import NeedleLossMixin


class NeedleSFTTrainer(NeedleLossMixin, SFTTrainer):
    """`trl.SFTTrainer` computing `needle_causal_lm_loss` (``mtp_loss_weight`` as in `NeedleLossMixin`)."""
