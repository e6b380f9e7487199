"""How one forward's input reaches the layers: block layout, full-sequence part and steps, packed documents."""

import torch
import torch.nn.functional as F

from .cache_bst import MAX_ROLLBACK
from .utils_bst import gather_rows, host_can_branch


def _step_weights_by_column(weights: torch.Tensor, kpos: torch.Tensor, positions: torch.Tensor, newest: int):
    """Decode-step attention weights over the ring `(B, H, 1, R)` -> by key column `(B, H, 1, newest + 1)`."""
    column = kpos - positions[:, None] + newest  # (B, R)
    valid = (kpos >= 0) & (column >= 0)
    out = weights.new_zeros(weights.shape[:-1] + (newest + 1,))
    index = column.clamp(min=0)[:, None, None, :].expand_as(weights)
    return out.scatter_add(-1, index, weights * valid[:, None, None, :].to(weights.dtype))


class StepPlan:
    """What one recurrent step at ``positions`` `(B,)` shares across the layers, each built by the first that asks."""

    def __init__(self, positions, doc_start, block_len: int, memo: dict | None, weights: bool = False):
        self.positions, self.doc_start, self.block_len, self.memo = positions, doc_start, block_len, memo
        self.weights, self.built = weights, {}

    def get(self, key, build):
        """``build()``, once per step."""
        if key not in self.built:
            self.built[key] = build()
        return self.built[key]

    @property
    def rows(self) -> torch.Tensor:
        return self.get("rows", lambda: torch.arange(self.positions.shape[0], device=self.positions.device))

    def slot(self, size: int) -> torch.Tensor:
        return self.get(("slot", size), lambda: self.positions.remainder(size))

    @property
    def offset(self) -> torch.Tensor:  # in the row's document
        return self.get("offset", lambda: self.positions - self.doc_start)

    @property
    def fresh(self) -> torch.Tensor:  # rows whose document starts here
        return self.get("fresh", lambda: self.positions == self.doc_start)

    @property
    def block_start(self) -> torch.Tensor:
        return self.get("block_start", lambda: self.offset.remainder(self.block_len) == 0)

    @property
    def block_end(self) -> torch.Tensor:
        return self.get("block_end", lambda: (self.offset + 1).remainder(self.block_len) == 0)


class _Chunk:
    """One forward's input as a chunk continuing the cache: the full-sequence form over the first ``head`` columns,
    one-token steps over the rest; what the full-sequence form of every layer reads (docs/architecture.md)."""

    def __init__(
        self, cache, attention_mask, shape, config, device, check: bool, memo=None, weights=False, columns=False
    ):
        bsz, seq_len = shape
        w = config.block_len
        self.seq_len, self.block_len, self.memo, self.weights = seq_len, w, memo, weights
        self.rows = None if cache is None else cache.layers[0]
        self.fresh = cache is None or self.rows.is_empty
        self.record = cache is not None and self.rows.record_past
        self.fill_cache = cache is not None  # layers write the cache
        self.plans = self.ssm_tables = self.mask = None  # ssm_tables: the model's S4D chunk tables for this forward
        self.positions = self.doc_start = self.lengths = None  # a continued chunk's row state; real tokens per row
        if self.fresh:
            head = seq_len
            if self.record and seq_len > 1:  # the last positions run as steps, which ``crop`` can take back
                head = seq_len - min(seq_len - 1, MAX_ROLLBACK)
                if attention_mask is not None:
                    real = attention_mask[:, -seq_len:].bool()
                    padded = torch.nonzero(~real.all(0))
                    head = max(head, int(padded[-1]) + 1) if len(padded) else head
                    # and every row's first real token (a left-padded row's head is not all padding)
                    head = max(head, int(real.to(torch.uint8).argmax(-1).max()) + 1)
            mask = None if attention_mask is None else attention_mask[:, -seq_len:][:, :head]
            self.lay_out(mask, bsz, head, device, check)
        else:
            if seq_len > 1 and attention_mask is not None and host_can_branch(attention_mask):
                if not bool(attention_mask[:, -seq_len:].all()):
                    raise ValueError(
                        "Padding inside a continued sequence cannot be honoured by the recurrent cache: pad the "
                        "first chunk only."
                    )
            self.positions, self.doc_start = self.rows.positions, self.rows.doc_start
            # A decode step (seq_len 1) reads no host mirror of a position: one traced step serves every position.
            common = self.rows.common_position if seq_len > 1 and seq_len % w == 0 and not self.record else None
            head = seq_len if common is not None and common % w == 0 and self.rows.docs_on_grid else 0
            if head:  # every row whole
                self.row_lengths = torch.full((bsz,), seq_len, dtype=torch.long, device=device)
        self.head = head
        self.columns = columns or 0 < head < seq_len

    def lay_out(self, attention_mask, bsz: int, head: int, device, check: bool):
        """The block layout of the first ``head`` columns: rows from their first real token, right-padded to a
        multiple of W."""
        self.padded_len = -(-head // self.block_len) * self.block_len
        self.common = head  # the rows' common length (None: they differ)
        if attention_mask is None:
            self.row_lengths = torch.full((bsz,), head, dtype=torch.long, device=device)
        else:
            mask = attention_mask.bool()
            if check and not bool(mask.any(-1).all()):
                raise ValueError("attention_mask has a row without any real token.")
            self.mask, self.row_lengths = mask, mask.sum(-1)
            # Real tokens first, in order: aligned index j of row b holds column order[b, j].
            self.order = torch.argsort((~mask).to(torch.uint8), dim=-1, stable=True)
            self.column_index = (mask.long().cumsum(-1) - 1).clamp(min=0)  # aligned index of every column
            self.real = torch.arange(head, device=device)[None] < self.row_lengths[:, None]  # (B, T) aligned
            same = host_can_branch(self.row_lengths) and bool((self.row_lengths == self.row_lengths[0]).all())
            self.common = int(self.row_lengths[0]) if same else None
        self.lengths = self.row_lengths if (self.mask is not None or self.padded_len != head) else None

    def to_blocks(self, hidden: torch.Tensor) -> torch.Tensor:
        """Caller's layout `(B, T, D)` -> aligned, right-padded `(B, T_pad, D)`; padding positions are zero."""
        if self.mask is not None:
            hidden = gather_rows(hidden, self.order) * self.real[..., None].to(hidden.dtype)
        return F.pad(hidden, (0, 0, 0, self.padded_len - self.head))

    def from_blocks(self, hidden: torch.Tensor) -> torch.Tensor:
        """Inverse of [`to_blocks`]: `(B, T_pad, D)` -> `(B, T, D)`; padding positions get zero hidden states."""
        hidden = hidden[:, : self.head]
        if self.mask is not None:
            hidden = gather_rows(hidden, self.column_index) * self.mask[..., None].to(hidden.dtype)
        return hidden

    def run(self, layer, layer_cache, hidden):
        """One layer over the chunk -> hidden states, the self- and second attention weights (None without)."""
        head, tail = (hidden[:, : self.head], hidden[:, self.head :]) if self.columns else (hidden, hidden)  # one used
        attn = cross = None
        if self.head:
            blocks = self.fresh and self.columns
            head, attn, cross = layer.sequence(self.to_blocks(head) if blocks else head, layer_cache, self)
            head = self.from_blocks(head) if blocks else head
        if self.head < self.seq_len:
            tail, tail_attn, tail_cross = self.steps(layer, layer_cache, tail)
            if attn is not None:  # the steps see more keys than the full-sequence part
                tail_attn = torch.cat([F.pad(attn, (0, tail_attn.shape[-1] - attn.shape[-1])), tail_attn], 2)
            attn, cross = tail_attn, (tail_cross if cross is None else torch.cat([cross, tail_cross], 2))
        if not self.head:
            return tail, attn, cross
        return (torch.cat([head, tail], 1) if self.head < self.seq_len else head), attn, cross

    def step_plans(self, n: int) -> list:
        """One [`StepPlan`] per step of the tail, shared by every layer."""
        if self.plans is None:
            if self.fresh:
                start, doc_start = self.row_lengths, torch.zeros_like(self.row_lengths)
            else:
                start, doc_start = self.positions, self.doc_start
            self.plans = [
                StepPlan(start if t == 0 else start + t, doc_start, self.block_len, self.memo, self.weights)
                for t in range(n)
            ]
        return self.plans

    def steps(self, layer, layer_cache, hidden):
        """The recurrent form over the columns of ``hidden`` `(B, n, D)`, one token per row at a time."""
        n = hidden.shape[1]
        newest = (self.head if self.fresh else self.rows.seen_tokens) if self.weights else 0  # a host read
        outs, attns, crosses = [], [], []
        for t, plan in enumerate(self.step_plans(n)):
            if self.record:  # what the step overwrites, for ``crop``
                layer_cache._undo.append(layer_cache.capture(plan.positions))
            h, attn, cross = layer.step(hidden[:, t : t + 1], layer_cache, plan)
            outs.append(h)
            if attn is not None:
                attn = _step_weights_by_column(attn, layer_cache.kpos, plan.positions, newest + t)
                attns.append(F.pad(attn, (0, n - 1 - t)))
            if cross is not None:
                crosses.append(cross)
        attn = torch.cat(attns, 2) if attns else None
        cross = torch.cat(crosses, 2) if crosses else None
        return (outs[0] if n == 1 else torch.cat(outs, 1)), attn, cross

    def finish(self):
        """The row state after the chunk (in the cache's first layer)."""
        if self.rows is None:
            return
        if self.fresh:
            self.rows.start(self.row_lengths, self.head, self.common)
            if self.head < self.seq_len:
                self.rows.advance(self.seq_len - self.head)
        else:
            self.rows.advance(self.seq_len)


class _Documents:
    """A packed batch (rows holding several documents) laid out one document per row, in groups of similar width."""

    KEYS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx", "max_length_q", "max_length_k")

    def __init__(self, starts: torch.Tensor, block_len: int):
        self.shape = starts.shape
        flat = starts.flatten()
        first = flat.nonzero()[:, 0]
        lengths = torch.diff(first, append=first.new_tensor([flat.numel()]))
        blocks = -(-lengths // block_len)
        width = block_len * torch.minimum(2 ** torch.log2(blocks.double()).ceil().long(), blocks.max())
        width, order = torch.sort(width, stable=True)
        widths, counts = (t.tolist() for t in torch.unique_consecutive(width, return_counts=True))
        self.sizes = [w * n for w, n in zip(widths, counts)]
        # Document order[j] fills slots start[j] ... of the concatenated (documents, width) groups.
        start = torch.empty_like(width).scatter_(0, order, width.cumsum(0) - width)
        doc = flat.long().cumsum(0) - 1
        offset = torch.arange(flat.numel(), device=flat.device) - first[doc]
        self.index = start[doc] + offset  # token i of the flattened batch sits at slot index[i]
        self.masks = [
            (torch.arange(w, device=flat.device) < n[:, None]) for w, n in zip(widths, lengths[order].split(counts))
        ]
        self.source = torch.zeros(sum(self.sizes), dtype=torch.long, device=flat.device)
        self.source[self.index] = torch.arange(flat.numel(), device=flat.device)

    def rows(self, x: torch.Tensor | None) -> list:
        """`(B, T, ...)` -> per group `(documents, width, ...)` (padding slots hold a copy of a token, masked)."""
        if x is None:
            return [None] * len(self.masks)
        slots = x.flatten(0, 1)[self.source].split(self.sizes)
        return [s.view(*m.shape, *x.shape[2:]) for s, m in zip(slots, self.masks)]

    def columns(self, groups: list) -> torch.Tensor:
        """Per group `(documents, width, ...)` -> the caller's `(B, T, ...)`."""
        flat = torch.cat([h.flatten(0, 1) for h in groups])
        return flat[self.index].view(*self.shape, *groups[0].shape[2:])

    @staticmethod
    def starts(kwargs: dict, attention_mask, shape) -> torch.Tensor | None:
        """`(B, T)` bool, True where a document starts, when some row holds several documents; else None."""
        bsz, seq_len = shape
        mask = None if attention_mask is None else attention_mask[:, -seq_len:].bool()
        found = {}
        pos = kwargs.get("position_ids")
        if pos is not None:
            if pos.dim() != 2 or pos.shape[1] != seq_len or pos.shape[0] not in (1, bsz):
                raise ValueError(f"position_ids must have shape ({bsz}, {seq_len}), got {tuple(pos.shape)}.")
            pos = pos.expand(bsz, seq_len)
            real = torch.ones_like(pos, dtype=torch.bool) if mask is None else mask
            # Each real token's previous real token (-1: none): generate's positions of a padded row are one document.
            last = torch.where(real, torch.arange(seq_len, device=pos.device), -1).cummax(-1).values
            prev = F.pad(last[:, :-1], (1, 0), value=-1)
            found["position_ids"] = real & (prev >= 0) & (pos != pos.gather(1, prev.clamp(min=0)) + 1)
        for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
            if (cu := kwargs.get(name)) is not None:
                cu = cu.flatten().long()
                if len(cu) < 2 or cu[0] != 0 or cu[-1] != bsz * seq_len or not bool((cu.diff() > 0).all()):
                    raise ValueError(
                        f"{name} must rise from 0 to {bsz * seq_len} (the batch's tokens), got {cu.tolist()}."
                    )
                flat = torch.zeros(bsz * seq_len, dtype=torch.bool, device=cu.device).index_fill(0, cu[:-1], True)
                if not bool(flat.view(shape)[:, 0].all()):
                    raise ValueError(f"{name} {cu.tolist()} has a document running from one row into the next.")
                found[name] = flat.view(shape)
        if (seq_idx := kwargs.get("seq_idx")) is not None:
            seq_idx = seq_idx.expand(bsz, seq_len)
            found["seq_idx"] = F.pad(seq_idx[:, 1:] != seq_idx[:, :-1], (1, 0))
        if not found:
            return None
        for v in found.values():
            v[:, 0] = True  # every row starts a document
        (first, starts), *others = found.items()
        for name, other in others:
            if not torch.equal(other, starts):
                at = [s.flatten().nonzero()[:, 0].tolist() for s in (other, starts)]
                raise ValueError(
                    f"{name} (documents at token offsets {at[0]}) disagree with {first} (documents at {at[1]})."
                )
        if not bool(starts[:, 1:].any()):
            return None  # one document per row: the common case reads nothing more back
        first_tokens = starts.flatten().nonzero()[:, 0]
        longest = int(torch.diff(first_tokens, append=first_tokens.new_tensor([bsz * seq_len])).max())
        for name in ("max_length_q", "max_length_k"):
            if kwargs.get(name) is not None and int(kwargs[name]) != longest:
                raise ValueError(f"{name}={int(kwargs[name])} but the longest document has {longest} tokens.")
        if mask is not None and not bool(mask.all()):
            raise ValueError(
                "A packed row (several documents per row) with an attention_mask with zeros: pass either packed "
                "rows without padding (no attention_mask) or padded rows of one document each."
            )
        return starts
