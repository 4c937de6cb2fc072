"""TRL's `SFTTrainer` with the Needle fine-tuning loss (see `needle_hf.finetune_torch`).

Use it like `SFTTrainer` on the conversations of `needle_hf.finetune_data.load_finetune_dataset`
with ``SFTConfig(assistant_only_loss=True)``: the chat template's
`{% generation %}` block marks the reference's loss tokens (target and EOS).
"""

from trl import SFTTrainer

from .finetune_torch import NeedleLossMixin


class NeedleSFTTrainer(NeedleLossMixin, SFTTrainer):
    """`trl.SFTTrainer` computing `needle_causal_lm_loss` (``mtp_loss_weight`` as in `NeedleLossMixin`)."""
