"""Fine-tuning the PyTorch Needle model with the Hugging Face stack: the loss, PEFT LoRA, Trainer, TRL.

The objective is the reference's (cactus-needle `finetune.py`): next-token cross-entropy on the
assistant target and the EOS only, averaged over every such token of the batch (one token mean, not
a mean of per-row means). Optionally the multi-token-prediction head joins it:

    loss = CE(logits[:, t], labels[:, t + 1]) + mtp_loss_weight * CE(mtp_logits[:, t], labels[:, t + 2])

where ``mtp_logits[:, t]`` scores token t + 2 (the MTP head reads the hidden state at t and the
embedding of token t + 1). Both terms average over their own target tokens; under gradient
accumulation `Trainer` passes ``num_items_in_batch`` (the next-token target count over the
accumulated batches) and both sums are divided by it, which keeps the accumulated gradient equal
to the one of the whole batch for the next-token term (the MTP term has one target fewer per row).

LoRA: `needle_lora_config` targets the five projections the reference adapts (q, k, v, gate and the
attention output, ``o_proj`` here for the reference's ``out_proj``) in the backbone layers only, not
the MTP block's. PEFT's ``lora_alpha / r`` scale is the reference's ``alpha / rank``; with
``lora_A.weight = A.T`` and ``lora_B.weight = B.T`` a reference adapter computes the same function.

The confidence head can join it too (``confidence_loss_weight``, `needle_hf.finetune.heads`): the
batch then carries extra rows of wrong answers (labels -100, so the language-model terms skip them)
and ``confidence_mask`` / ``confidence_labels``, and the head's binary cross-entropy on every row,
read off the same forward, trains the backbone to tell right answers from wrong ones.

`NeedleTrainer` (a `transformers.Trainer`) and `needle_hf.finetune.trainer_trl.NeedleSFTTrainer` (a TRL `SFTTrainer`) compute this
loss themselves: `SFTTrainer`'s own loss (the last hidden state through `get_output_embeddings()`,
the bias-less tied `lm_head`, in tiles) would skip the MTP head; `NeedleLossMixin.compute_loss`
replaces it. `SFTConfig`'s defaults, gradient checkpointing included, work.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.utils import is_datasets_available

from .data import IGNORE_INDEX, checked_option
from .heads import confidence_loss
from .shared_prefix import shared_prefix_forward

#: Module names (PyTorch) of the reference's LoRA targets; ``o_proj`` is its ``out_proj``.
LORA_TARGET_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "o_proj")
#: PEFT ``target_modules`` regex: those projections in the backbone layers (not the MTP block).
BACKBONE_LORA_TARGETS = r"model\.layers\.\d+\.self_attn\.(" + "|".join(LORA_TARGET_PROJECTIONS) + ")"


def needle_lora_config(*, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0):
    """`peft.LoraConfig` of the reference's adapter: rank ``rank``, scale ``alpha / rank``, no bias."""
    from peft import LoraConfig

    rank = checked_option("rank", rank, low=1, integer=True)
    alpha = checked_option("alpha", alpha, low=0, low_inclusive=False)
    dropout = checked_option("dropout", dropout, low=0, high=1, high_inclusive=False)
    return LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none", target_modules=BACKBONE_LORA_TARGETS,
        task_type="CAUSAL_LM",
    )


def _shifted_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, shift: int, denominator, position_ids: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Sum of CE(logits[:, t], labels[:, t + shift]) over labelled targets, divided by ``denominator``.

    logits [B, T, V] float32, labels [B, T] (-100 = no target); position_ids [B, T] of a packed batch:
    a target at position < shift belongs to another sequence than the logit that would score it.
    """
    if position_ids is not None:
        labels = labels.masked_fill(position_ids.to(labels.device) < shift, IGNORE_INDEX)
    targets = labels[:, shift:].to(logits.device)
    scores = logits[:, :-shift].float()
    total = F.cross_entropy(
        scores.reshape(-1, scores.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    if denominator is None:
        denominator = (targets != IGNORE_INDEX).sum()
    return total / torch.as_tensor(denominator, device=total.device).clamp(min=1)


def needle_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    mtp_logits: Optional[torch.Tensor] = None,
    mtp_loss_weight: float = 0.0,
    num_items_in_batch=None,
    position_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The Needle fine-tuning loss (see the module docstring).

    Args:
        logits: [B, T, V] next-token logits (``logits[:, t]`` scores token t + 1).
        labels: [B, T] the input ids, -100 outside the loss mask (prompt, BOS, padding).
        mtp_logits: [B, T, V] MTP logits (``mtp_logits[:, t]`` scores token t + 2); needed when
            ``mtp_loss_weight > 0``.
        num_items_in_batch: the next-token target count of the whole (accumulated) batch, from
            `Trainer`; None divides each term by its own target count in this batch.
        position_ids: [B, T] of a packed (padding-free) batch, positions restarting at 0 for each
            sequence: no term scores a target of the next sequence, so the loss is the padded batch's.
    Returns:
        scalar float32 loss.
    """
    _check_scores("logits", logits, labels)
    mtp_loss_weight = checked_option("mtp_loss_weight", mtp_loss_weight, low=0)
    loss = _shifted_cross_entropy(logits, labels, 1, num_items_in_batch, position_ids)
    if mtp_loss_weight:
        if mtp_logits is None:
            raise ValueError("mtp_loss_weight > 0 needs mtp_logits (call the model with return_mtp_logits=True)")
        _check_scores("mtp_logits", mtp_logits, labels)
        loss = loss + mtp_loss_weight * _shifted_cross_entropy(mtp_logits, labels, 2, num_items_in_batch, position_ids)
    return loss


def _check_scores(name: str, scores, labels) -> None:
    """Scores [B, T, V] float and labels [B, T] integer of the same batch and length."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3 or not scores.is_floating_point():
        found = f"{scores.dtype} {tuple(scores.shape)}" if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"{name}: expected a float tensor [batch, tokens, vocab], found {found}")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or labels.is_floating_point() \
            or tuple(labels.shape) != tuple(scores.shape[:2]):
        found = f"{labels.dtype} {tuple(labels.shape)}" if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels: expected an integer tensor {tuple(scores.shape[:2])} (as {name}), found {found}")


class NeedleLossMixin:
    """`compute_loss` for `Trainer` subclasses: `needle_causal_lm_loss`, with the MTP term when
    ``mtp_loss_weight > 0``.

    Args:
        mtp_loss_weight: weight of the MTP head's t + 2 loss (0 = next-token loss only).
        confidence_loss_weight: weight of the confidence head's binary cross-entropy (0 = none); the
            batches must come from `needle_hf.finetune.heads.ConfidenceRowsCollator`.
        Every other argument is the trainer's.
    """

    def __init__(self, *args, mtp_loss_weight: float = 0.0, confidence_loss_weight: float = 0.0,
                 **trainer_arguments):
        mtp_loss_weight = checked_option("mtp_loss_weight", mtp_loss_weight, low=0)
        confidence_loss_weight = checked_option("confidence_loss_weight", confidence_loss_weight, low=0)
        super().__init__(*args, **trainer_arguments)
        self.mtp_loss_weight = mtp_loss_weight
        self.confidence_loss_weight = confidence_loss_weight

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        confidence_mask, confidence_labels = inputs.pop("confidence_mask", None), inputs.pop("confidence_labels", None)
        # TRL's collator adds bookkeeping columns the model does not take. A padding-free batch keeps
        # its position_ids (and varlen boundaries): they mark where each packed sequence starts.
        for name in ("completion_mask", "assistant_masks"):
            inputs.pop(name, None)
        if "attention_mask" in inputs:
            inputs.pop("position_ids", None)  # a padded batch's positions follow from its mask
        position_ids = inputs.get("position_ids")
        prefix_ids = inputs.pop("prefix_ids", None)
        with_mtp = self.mtp_loss_weight > 0
        with_confidence = self.confidence_loss_weight > 0
        if with_confidence and confidence_labels is None:
            raise ValueError("confidence_loss_weight > 0 needs batches with confidence_mask and confidence_labels"
                             " (needle_hf.finetune.heads.ConfidenceRowsCollator)")
        if prefix_ids is not None:
            if with_mtp or with_confidence:
                raise ValueError("shared-prefix batches (prefix_ids) train the next-token loss only: set "
                                 "mtp_loss_weight and confidence_loss_weight to 0, or collate with NeedlePaddingCollator")
            outputs = shared_prefix_forward(model, prefix_ids=prefix_ids, input_ids=inputs["input_ids"],
                                            attention_mask=inputs["attention_mask"])
        else:
            outputs = model(**inputs, use_cache=False, return_mtp_logits=with_mtp,
                            output_hidden_states=with_confidence)
        loss = needle_causal_lm_loss(
            outputs.logits, labels, mtp_logits=outputs.mtp_logits if with_mtp else None,
            mtp_loss_weight=self.mtp_loss_weight, num_items_in_batch=num_items_in_batch, position_ids=position_ids,
        ) * self._token_loss_scale(num_items_in_batch)
        if with_confidence:
            cells = model.cells_from_hidden_states(inputs["input_ids"], outputs.hidden_states)  # [B, T, L + 1, d]
            logits = model.confidence_head(cells, confidence_mask.bool(), model.model.embed_tokens.weight.dtype)
            loss = loss + self.confidence_loss_weight * confidence_loss(logits, confidence_labels)
        return (loss, outputs) if return_outputs else loss

    def _token_loss_scale(self, num_items_in_batch) -> int:
        """The factor of the token-averaged terms under data parallelism, as `Trainer.compute_loss` applies it.

        With ``average_tokens_across_devices`` `Trainer` counts ``num_items_in_batch`` over every
        process, so each process's sum over that count is its share of the global token mean; DDP then
        averages the processes' gradients, so the share is scaled by the process count to make the
        averaged gradient the global mean's. (The confidence term is a per-batch mean, which DDP's
        average already turns into the global one.)
        """
        if num_items_in_batch is None or not self.args.average_tokens_across_devices:
            return 1
        return self.args.n_gpu if self.args.n_gpu > 1 else self.accelerator.num_processes


def _is_arrow_dataset(dataset) -> bool:
    """Whether ``dataset`` is a `datasets.Dataset` (an optional dependency: absent where only serving runs)."""
    if not is_datasets_available():
        return False
    import datasets

    return isinstance(dataset, datasets.Dataset)


class NeedleTrainer(NeedleLossMixin, Trainer):
    """`transformers.Trainer` with the Needle fine-tuning loss (``mtp_loss_weight`` as in `NeedleLossMixin`).

    Args:
        train_batch_sampler: batches of training-set indices in place of `Trainer`'s sampler and
            ``per_device_train_batch_size`` (one process), e.g.
            `needle_hf.finetune.shared_prefix.PrefixGroupedBatchSampler` with `SharedPrefixCollator`:
            rows that offer the same tools then run their common prompt once per batch.
        Every other argument is `NeedleLossMixin`'s and the trainer's.
    """

    def __init__(self, *args, train_batch_sampler=None, **trainer_arguments):
        super().__init__(*args, **trainer_arguments)
        if train_batch_sampler is not None:
            if not hasattr(train_batch_sampler, "__iter__") or not hasattr(train_batch_sampler, "__len__"):
                raise ValueError(f"train_batch_sampler: expected an iterable of index lists with a length, found "
                                 f"{type(train_batch_sampler).__name__}")
            if self.args.world_size > 1:
                raise ValueError(f"train_batch_sampler: batches are drawn for one process; this run has "
                                 f"{self.args.world_size}")
        self.train_batch_sampler = train_batch_sampler

    def get_train_dataloader(self):
        if self.train_batch_sampler is None:
            return super().get_train_dataloader()
        if self.train_dataset is None:
            raise ValueError("NeedleTrainer: training needs a train_dataset")
        rows, keyed = len(self.train_dataset), getattr(self.train_batch_sampler, "rows", None)
        if keyed is not None and keyed != rows:
            raise ValueError(f"train_batch_sampler: expected one key per training row ({rows}), found {keyed}")
        dataset, collator = self.train_dataset, self.data_collator
        if _is_arrow_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        loader = DataLoader(dataset, batch_sampler=self.train_batch_sampler, collate_fn=collator,
                            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory)
        return self.accelerator.prepare(loader)
