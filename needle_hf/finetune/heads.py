"""Training the contrastive (tool routing) and confidence heads of the PyTorch Needle model.

The reference defines both heads but ships no objective for them: its fine-tuning never tunes them,
and whatever pre-trained them is not in the package. Its ``forward_contrastive`` and
``forward_confidence`` stop the gradient at the backbone's cells, so the heads are trained on a
fixed backbone; we do the same (cells under ``torch.no_grad``), which leaves the language model,
its MTP head and every answer unchanged. The objectives are the standard ones, stated to match how
`needle_hf.tools.tool_routing` reads the heads:

- Contrastive: InfoNCE (van den Oord et al. 2018) with the head's learnt temperature (as CLIP):
  for query embeddings q [B, C], tool embeddings t [N, C] (all L2-normalised) and the index of each
  query's tool,

      loss = mean_b [ -log softmax_n(q_b . t_n / tau)[target_b] ],   tau = exp(log_temperature),

  the other tools of the catalogue being the negatives. `rank_tools` ranks by the same cosine and
  reports the same softmax as ``probability``. Query text ``[BOS] + query``, tool text
  ``[BOS] + tool_text(tool)`` (`tool_routing.tool_text`).
- Confidence: binary cross-entropy of the head's logit against 1 for a right answer and 0 for a
  wrong one (e.g. another tool, a changed or a dropped argument). A turn is read as
  `NeedleToolCaller` reads it: the prompt ids (chat template with the generation prompt) followed
  by the answer ids, EOS removed (`turn_ids`).

Axis letters: B batch, T tokens, C contrastive width, N tools.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX, FinetuneDataError, NeedlePaddingCollator, example_to_conversation, encode_conversation


def contrastive_loss(
    query_embeddings: torch.Tensor, tool_embeddings: torch.Tensor, log_temperature: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """InfoNCE of queries against a tool catalogue (see the module docstring).

    Args:
        query_embeddings: [B, C] L2-normalised query embeddings.
        tool_embeddings: [N, C] L2-normalised tool embeddings (the catalogue: targets and negatives).
        log_temperature: scalar, the head's log temperature.
        targets: [B] int, index in the catalogue of each query's tool.
    Returns:
        scalar float32 loss.
    """
    scores = query_embeddings.float() @ tool_embeddings.float().T / log_temperature.float().exp()  # [B, N]
    return F.cross_entropy(scores, targets.to(scores.device))


def confidence_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of confidence logits [B] against labels [B] (1 = right answer, 0 = wrong)."""
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float().to(logits.device))


def turn_ids(tokenizer, example: dict) -> list[int]:
    """Ids of one turn as `NeedleToolCaller` scores it: ``[BOS] + prompt + answer`` (no EOS).

    ``example`` is a fine-tuning example {"query", "tools", "answers"} whose answers are the ones to
    score (right or wrong); a wrong answer may call a tool the example does not offer.
    """
    conversation = example_to_conversation(example, offered_tools_only=False)
    ids, _ = encode_conversation(tokenizer, conversation["messages"], conversation["tools"])
    return ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids


class ConfidenceRowsCollator:
    """Batches for `NeedleTrainer(confidence_loss_weight=...)`: training rows plus rows of wrong answers.

    Each row has ``input_ids`` / ``labels`` (`tokenize_conversations`) and ``wrong_input_ids``: the
    `turn_ids` of a wrong answer to the same prompt, or ``[]``. The batch is the rows followed by
    their wrong answers, right padded (`NeedlePaddingCollator`), with the wrong rows' labels all -100,
    plus ``confidence_mask`` [B', T] (the turn each row's confidence is read over: a training row
    without its final EOS, a wrong row whole) and ``confidence_labels`` [B'] (1.0 right, 0.0 wrong).
    """

    def __init__(self, *, pad_token_id: int):
        self.padding = NeedlePaddingCollator(pad_token_id=pad_token_id)

    def __call__(self, rows: list[dict]) -> dict:
        if not isinstance(rows, list) or not rows:
            raise FinetuneDataError(f"rows: expected a non-empty list of rows, found {rows!r:.60}")
        for index, row in enumerate(rows):
            if not isinstance(row, dict) or not all(key in row for key in ("input_ids", "labels")):
                raise FinetuneDataError(f"rows[{index}]: expected a dict with 'input_ids', 'labels' and optionally "
                                        f"'wrong_input_ids', found {row!r:.60}")
            if not row["input_ids"]:
                raise FinetuneDataError(f"rows[{index}]: 'input_ids' is empty; expected a tokenized training row")
        wrong = [row["wrong_input_ids"] for row in rows if row.get("wrong_input_ids")]
        batch = self.padding([{"input_ids": row["input_ids"], "labels": row["labels"]} for row in rows]
                             + [{"input_ids": ids, "labels": [IGNORE_INDEX] * len(ids)} for ids in wrong])
        mask = batch["attention_mask"].clone()
        lengths = mask[: len(rows)].sum(-1)  # the training rows end with their EOS
        mask[torch.arange(len(rows)), lengths - 1] = 0
        batch["confidence_mask"] = mask
        batch["confidence_labels"] = torch.tensor([1.0] * len(rows) + [0.0] * len(wrong))
        return batch


def _padded(rows: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, T] and attention mask [B, T] (the padding side of `tool_routing`)."""
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, length - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[index, length - len(row):] = 1
    return ids, mask


@torch.no_grad()
def backbone_cells(model, rows: Sequence[Sequence[int]], *, batch_size: int = 32) -> list[torch.Tensor]:
    """The heads' input of each row of ids: cells [T_i, L + 1, d] float32 of its own length (no gradient).

    Rows are run left padded in batches of ``batch_size``; RoPE is relative and padding is masked,
    so a row's cells do not depend on its batch.
    """
    cells = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        ids, mask = _padded(chunk, model.config.pad_token_id)
        batch, _ = model._probe_cells(ids.to(model.device), mask.to(model.device))  # [B, T, L + 1, d]
        cells += [batch[index, batch.shape[1] - len(row):].cpu() for index, row in enumerate(chunk)]
    return cells


def _stacked(cells: Sequence[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded cells [B, T, L + 1, d] and keep mask [B, T] of rows of `backbone_cells`."""
    length = max(row.shape[0] for row in cells)
    out = cells[0].new_zeros((len(cells), length, *cells[0].shape[1:]))
    keep = torch.zeros((len(cells), length), dtype=torch.bool)
    for index, row in enumerate(cells):
        out[index, length - row.shape[0]:] = row
        keep[index, length - row.shape[0]:] = True
    return out.to(device), keep.to(device)


def head_losses(
    model, *, query_cells: Sequence[torch.Tensor], tool_cells: Sequence[torch.Tensor], targets: Sequence[int],
    turn_cells: Optional[Sequence[torch.Tensor]] = None, labels: Optional[Sequence[float]] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(contrastive loss, confidence loss or None) of one batch, differentiable in the heads only.

    query_cells: `backbone_cells` of B query texts; tool_cells: of the N catalogue tools; targets:
    [B] catalogue index of each query's tool; turn_cells: of B' turns (`turn_ids`), or None;
    labels: [B'] 1 = right answer, 0 = wrong.
    """
    dtype = model.model.embed_tokens.weight.dtype
    head = model.contrastive_head
    queries = head(*_stacked(query_cells, model.device), dtype)  # [B, C]
    tools = head(*_stacked(tool_cells, model.device), dtype)  # [N, C]
    contrastive = contrastive_loss(queries, tools, head.log_temperature, torch.tensor(list(targets)))
    if turn_cells is None:
        return contrastive, None
    logits = model.confidence_head(*_stacked(turn_cells, model.device), dtype)  # [B']
    return contrastive, confidence_loss(logits, torch.tensor(list(labels)))


def _check_rows(field: str, rows, vocab_size: int) -> None:
    """Rows of token ids: a non-empty list of non-empty int lists, every id in [0, vocab_size)."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) or not rows:
        found = "an empty list" if isinstance(rows, Sequence) and not rows else type(rows).__name__
        raise ValueError(f"{field}: expected a non-empty list of token id lists, found {found}")
    for index, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or not row:
            raise ValueError(f"{field}[{index}]: expected a non-empty list of token ids, found {row!r:.60}")
        for token in row:
            if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < vocab_size:
                raise ValueError(f"{field}[{index}]: expected token ids (ints in [0, {vocab_size})), found {token!r:.60}")


def _check_training_options(*, steps, batch_size, learning_rate, seed, log_every) -> None:
    for name, value, least in (("steps", steps, 1), ("batch_size", batch_size, 1), ("log_every", log_every, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}: expected an int >= {least}, found {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int, found {seed!r}")
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not (
            math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate: expected a finite number > 0, found {learning_rate!r}")


def train_heads(
    model, *, query_ids: Sequence[Sequence[int]], targets: Sequence[int], tool_ids: Sequence[Sequence[int]],
    turns: Optional[Sequence[Sequence[int]]] = None, labels: Optional[Sequence[float]] = None, steps: int,
    batch_size: int = 32, learning_rate: float = 3e-3, seed: int = 0, log_every: int = 0,
) -> list[tuple[float, Optional[float]]]:
    """Fit the contrastive head (and the confidence head when ``turns`` are given) on the fixed backbone, in place.

    Args:
        query_ids / targets: query texts' ids (``[BOS] + query``) and the catalogue index of each one's tool.
        tool_ids: the catalogue's tool texts' ids (``[BOS] + tool_text(tool)``), every query's negatives.
        turns / labels: `turn_ids` rows and 1.0 (right answer) or 0.0 (wrong); None leaves the
            confidence head as it is.
    The backbone's cells of every row are computed once (it is fixed, as the reference stops the
    gradient there); each step draws ``batch_size`` queries and ``batch_size`` turns; AdamW with
    warm-up and linear decay, gradient clipping 1.0. Returns the (contrastive, confidence) loss of
    every step.
    """
    if getattr(model, "contrastive_head", None) is None or (
            turns is not None and getattr(model, "confidence_head", None) is None):
        raise ValueError("train_heads needs the contrastive head (and the confidence head to fit turns)")
    _check_training_options(steps=steps, batch_size=batch_size, learning_rate=learning_rate, seed=seed,
                            log_every=log_every)
    vocab_size = model.config.vocab_size
    _check_rows("query_ids", query_ids, vocab_size)
    _check_rows("tool_ids", tool_ids, vocab_size)
    if turns is not None:
        _check_rows("turns", turns, vocab_size)
    if len(query_ids) != len(targets) or (turns is not None and (labels is None or len(turns) != len(labels))):
        raise ValueError(f"train_heads: expected one target per query and one label per turn, got "
                         f"{len(query_ids)} queries / {len(targets)} targets, "
                         f"{None if turns is None else len(turns)} turns / {None if labels is None else len(labels)} labels")
    for index, target in enumerate(targets):
        if isinstance(target, bool) or not isinstance(target, numbers.Integral) or not 0 <= target < len(tool_ids):
            raise ValueError(f"targets[{index}]: expected a catalogue index in [0, {len(tool_ids)}), found {target!r}")
    for index, label in enumerate(labels or ()):
        if isinstance(label, bool) or not isinstance(label, numbers.Real) or not 0.0 <= label <= 1.0:
            raise ValueError(f"labels[{index}]: expected a number in [0, 1] (1 = right answer), found {label!r}")
    query_cells, tool_cells = backbone_cells(model, query_ids), backbone_cells(model, tool_ids)
    turn_cells = None if turns is None else backbone_cells(model, turns)
    parameters = list(model.contrastive_head.parameters())
    if turns is not None:
        parameters += list(model.confidence_head.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * max(0.0, 1.0 - step / steps))
    generator = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps):
        queries = torch.randint(len(query_ids), (batch_size,), generator=generator).tolist()
        rows = None if turns is None else torch.randint(len(turns), (batch_size,), generator=generator).tolist()
        contrastive, confidence = head_losses(
            model, query_cells=[query_cells[i] for i in queries], tool_cells=tool_cells,
            targets=[targets[i] for i in queries],
            turn_cells=None if rows is None else [turn_cells[i] for i in rows],
            labels=None if rows is None else [labels[i] for i in rows])
        optimizer.zero_grad()
        (contrastive if confidence is None else contrastive + confidence).backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        history.append((contrastive.item(), None if confidence is None else confidence.item()))
        if log_every and (step + 1) % log_every == 0:
            print(f"      heads step {step + 1}: contrastive {history[-1][0]:.4f}, confidence {history[-1][1]}")
    return history


__all__ = ["ConfidenceRowsCollator", "backbone_cells", "confidence_loss", "contrastive_loss", "head_losses", "train_heads", "turn_ids"]
