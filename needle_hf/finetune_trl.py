"""TRL's `SFTTrainer` with the Needle fine-tuning loss (see `needle_hf.finetune_torch`).

Use it like `SFTTrainer` on the conversations of `needle_hf.finetune_data.load_finetune_dataset`
with ``SFTConfig(assistant_only_loss=True, gradient_checkpointing=False)``: the chat template's
`{% generation %}` block marks the reference's loss tokens (target and EOS).
"""

from trl import SFTTrainer

from .finetune_torch import NeedleLossMixin


class NeedleSFTTrainer(NeedleLossMixin, SFTTrainer):
    """`trl.SFTTrainer` computing `needle_causal_lm_loss`.

    Args:
        mtp_loss_weight: weight of the MTP head's t + 2 loss (0 = next-token loss only).
        Every other argument is `SFTTrainer`'s.
    """

    def __init__(self, *args, mtp_loss_weight: float = 0.0, **trainer_arguments):
        super().__init__(*args, **trainer_arguments)
        self.mtp_loss_weight = float(mtp_loss_weight)
