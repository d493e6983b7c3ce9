"""All-gather across ranks with gradients flowing back to the owning rank.

Every loss computes its *local* rows (this rank's samples) against the *global* batch
(all ranks' samples), the "local loss" form of open_clip. Batch sizes may differ across
ranks (the last batch of an epoch, a dataset that does not divide evenly): tensors are
padded to the largest local batch, gathered, and the padding is cut off again. Finding the
sizes is a small collective and a host sync; with the losses' value checks off
(``validate_args=False``, or under ``torch.compile``) it is skipped and every rank must
hold the same batch size.

Rank agreement: before the first gather of a call, every rank shares one fixed-length
header (:func:`validate_together`): whether its checks run, whether they failed, its batch
size, a fingerprint of the loss's effective settings (temperature and the scale's dtype,
reduction, ``chunk_size``, an SVR radius, CACL's ``english_index``, ASK's effective
``k_coarse`` and bank backend, a dynamic radius predictor's checksum, a wrapper's own
settings such as the drop-in ``ClipLoss``'s ``local_loss``, ...), the number of this call
among the loss Module's gathered calls, and the dtype, trailing shape and autograd state
(``requires_grad`` with grad mode on) of what it will gather (embeddings, ids, knowledge).
:func:`check_call_counts` compares the ranks' totals of calls, and the order of their kinds
(training, evaluation), through the same exchange. Under ``torch.compile`` the header is
built in the graph and exchanged by a custom op that runs eager (see
:func:`validate_together`).
Ranks whose checks run compare
the headers and raise one clear error together; a rank with the checks off sends its
header (zeros, made on the device) without reading anything back, so the collectives stay
paired whatever each rank's ``validate_args`` and no host sync is added there.

The returned loss on each rank is scaled so that the *average over ranks* — what
``DistributedDataParallel`` does to gradients — equals the single-process loss on the
concatenated batch, and its gradient equals the single-process gradient.
"""

from ._gather import all_gather_no_grad, all_gather_with_grad, is_distributed, resolve_gather
from ._rank_agreement import call_count, check_call_counts, validate_together

# Not public, re-exported for the losses and wrappers that import them from here
# (``counted_call`` on each ``forward``, ``Validation`` in the shared path, the drop-in
# ``ClipLoss``'s ``outer_settings``) and for benchmarks/bench_rank_exchange.py (``_HEADER``).
from ._rank_agreement import counted_call as counted_call
from ._rank_agreement import outer_settings as outer_settings
from ._rank_header import _HEADER as _HEADER
from ._rank_header import Validation as Validation

__all__ = [
    "all_gather_no_grad",
    "all_gather_with_grad",
    "call_count",
    "check_call_counts",
    "is_distributed",
    "resolve_gather",
    "validate_together",
]
