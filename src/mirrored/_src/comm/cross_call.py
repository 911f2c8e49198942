"""`CrossWorkerCalls`: one checked call across workers, the protocol that
`DistributedCommunicator` (see its module) runs for every collective: the call's
identity, the trailer inside the data or the header beside it, the prediction of
the next call's sizes, and the waits (through a `CallWatch`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..devices import Device
from ..topology import Topology
from . import trailer
from .call_identity import (
    CallLedger,
    JobLink,
    UserCall,
    Wire,
    call_identity,
    identity_hash,
    user_call,
)
from .exchange import EXCHANGED, pair_exchange
from .watch import CallWatch, short

__all__ = ["GATHER", "HEAD", "VALUE", "CrossWorkerCalls", "PendingCall"]

_DIST_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
HEAD = 5  # identity, prediction, miss, flag, value; then one size per local replica
VALUE = 4  # the header's value field (a count, a vote's int)
GATHER: Wire = (("gather", "", 0),)  # sizes known only from the header
# One flat all-gather of the header rows (torch 2.13 deprecates all_gather_into_tensor
# in favour of all_gather_single); the list form where a backend has neither
# (`_gather_rows`).
_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CrossWorkerCalls:
    """Runs checked calls for one communicator (see `call`).

    Example:
        >>> CrossWorkerCalls.__name__
        'CrossWorkerCalls'
    """

    def __init__(self, group: Any, ledger: CallLedger, watch: CallWatch, job: JobLink | None,
                 check: bool, topology: Topology, wire: Device) -> None:
        self._group = group
        self._ledger = ledger
        self.watch = watch
        self._job = job
        self._check = check
        self._world = topology.num_workers
        self._local_replicas = topology.num_local_replicas
        self._wire = wire
        self._wire_hashes: dict[Wire, int] = {}
        self._codecs: dict[tuple[str, str, int], trailer.Codec | None] = {}
        # a call's key (its text) and the key's hash, per (phase, entry, site, what, wire)
        self._keys: dict[tuple[Any, ...], tuple[str, int]] = {}
        self._host = wire.torch_device.type == "cpu"  # trailers written as raw bytes
        self._direct = _direct_all_reduce(group)
        # Two workers on Gloo: a SUM is one exchange (`exchange`), bitwise the same as
        # the all-reduce's; headers keep Gloo's all-gather (see `exchange.Pair`)
        self._pair = pair_exchange(group, self._world, self._host)
        self.exchanges = self._pair is not None  # (a `call`'s ``sources`` can be read)
        self._flat_gather = True  # (see `_gather_rows`)
        self._following: tuple[int, object] = (0, "gather")  # the latest gather's (`follow`)

    def call(self, what: str, wire: Wire, data: list[torch.Tensor], *, flag: int = 0,
             value: int = 0, sizes: Sequence[int] = (),
             fill: Callable[[int], None] | None = None,
             sources: Sequence[torch.Tensor | None] = ()) -> list[list[int]]:
        """One checked cross-worker call (see the module's docstring): launches
        ``data``'s collectives (kinds and sizes in ``wire``) with the header and returns
        the header table (one row per worker) once every identity agrees. ``fill(i)``,
        when given, writes ``data[i]``'s payload right before its collective is
        launched (so copying the next buffer overlaps the previous one's transfer); it
        never touches a trailer. ``sources[i]``, when given, holds exactly what
        ``fill(i)`` would copy into the whole of ``data[i]``: an exchange reads it there
        and leaves the sum in ``data[i]`` all the same, with no copy first."""
        ledger = self._ledger
        if ledger.broken is not None:
            raise RuntimeError(f"this strategy's cross-worker communication is unusable after "
                               f"an earlier failure ({ledger.broken}); restart the job")
        who = user_call()
        known = (ledger.in_run, who.entry, who.site, what, wire)
        keyed = self._keys.get(known)
        if keyed is None:  # (a loop repeats its calls: the key is kept)
            keyed = self._key(known, f"{ledger.in_run}|{who}|{what}|{wire}")
        key, key_hash = keyed
        index = ledger.index + 1
        seq, prediction = ledger.enter(key, wire)
        text = _CallText(who, what, index, ledger.in_run, ledger.run)
        check = self._check
        ident = call_identity(key_hash, seq, ledger.run, index, ledger.examples) if check else 0
        if self._job is not None:
            # (launched calls may be pending; the identity lets peers see a divergence)
            self._job.note_progress(seq, ledger.completed, ident)
            self.watch.started(seq, text)
            self.watch.fail_if_gone(seq, text)
        predicted = self._wire_hash(prediction) if check and prediction else 0
        agreed, ledger.agreed = ledger.agreed, None
        if not check and wire and wire != GATHER:
            # unchecked: data only
            self.watch.wait(self._launch(wire, data, fill, sources), seq, text)
            self._done(seq)
            return []
        if agreed is not None and agreed != GATHER:
            codec = self._codec(agreed)  # the check rides in the data
            if agreed == wire:  # header and data together
                if codec is not None:
                    end, expected = self._stamp(codec, data[0], ident, predicted, 0)
                    self.watch.wait(self._launch(wire, data, fill, sources), seq, text)
                    same, guess, miss = self._read(codec, data[0], end, expected, predicted)
                    if miss == 0:
                        if not same:
                            self.watch.mismatch(seq, text)
                        ledger.agreed = ledger.predicted if guess == predicted != 0 else None
                        self._done(seq)
                        return []
                else:
                    table = self._round(self._row(ident, predicted, flag, value, sizes),
                                        self._launch(wire, data, fill, sources), seq, text)
                    if not any(r[2] for r in table):
                        return self._verified(table, seq, text)
            else:
                self._miss(agreed, ident, self._row(ident, predicted, flag, value, sizes, miss=1),
                           seq, text)
        # The header first, then the data: the call is completed only after its data
        # step (a gather's, whose sizes the header gave: `follow`), so that a worker
        # leaving there is named as inside it.
        follows = wire == GATHER or bool(data)
        table = self._verified(self._round(self._row(ident, predicted, flag, value, sizes), [],
                                           seq, text), seq, text, done=not follows)
        if wire == GATHER:
            self._following = (seq, text)
        elif data:  # (refilled: a miss above may have reduced them)
            self.watch.wait(self._launch(wire, data, fill, sources), seq, text)
            self._done(seq)
        return table

    def follow(self, works: list[Any]) -> None:
        """Waits for the data step of the latest call, a gather (``GATHER``: the sizes
        came in its header table), and marks that call completed."""
        seq, text = self._following
        assert seq == self._ledger.seq, "a call entered between a gather's header and data"
        self.watch.wait(works, seq, text)
        self._done(seq)

    def launch(self, what: str, wire: Wire, data: list[torch.Tensor]) -> PendingCall:
        """Starts one checked call whose sizes are known to match the peers' (a
        gradient bucket after its plan's first, fully checked step) without waiting:
        its identity rides in the trailer of ``data[0]`` (its last elements, when the
        check is on); `finish` waits and checks. The identity names ``what`` and no
        call site (one worker may launch a bucket in backward, another at the step)."""
        ledger = self._ledger
        if ledger.broken is not None:
            raise RuntimeError(f"this strategy's cross-worker communication is unusable after "
                               f"an earlier failure ({ledger.broken}); restart the job")
        known = (ledger.in_run, what, wire)
        keyed = self._keys.get(known)
        if keyed is None:
            keyed = self._key(known, f"{ledger.in_run}|{what}|{wire}")
        key, key_hash = keyed
        index = ledger.index + 1
        seq, prediction = ledger.enter(key, wire)
        agreed, ledger.agreed = ledger.agreed, None  # (this call's sizes: by its plan)
        text = f"{short(what)} (collective {index} {ledger.phase_text()})"
        ident = (call_identity(key_hash, seq, ledger.run, index, ledger.examples)
                 if self._check else 0)
        if self._job is not None:
            self._job.note_progress(seq, ledger.completed, ident)
            self.watch.started(seq, text)
            self.watch.fail_if_gone(seq, text)
        codec = self._codec(wire) if self._check else None
        predicted, end, expected = 0, 0, b""
        if self._check:
            predicted = self._wire_hash(prediction) if prediction else 0
            if agreed is not None and agreed != wire:
                # Every worker predicted another call here: a peer that makes it sends
                # its sizes at once, and a bucket of other sizes would end its process
                # (Gloo). Meet that call with a miss, then settle in a header round.
                if agreed != GATHER:
                    self._miss(agreed, ident, self._row(ident, predicted, 0, 0, (), miss=1),
                               seq, text)
                self._verified(self._round(self._row(ident, predicted, 0, 0, ()), [], seq,
                                           text), seq, text, done=False)
            if codec is not None:
                end, expected = self._stamp(codec, data[0], ident, predicted, 0)
        return PendingCall(self._launch(wire, data), data[0], codec, end, seq, text, predicted,
                           expected)

    def finish(self, pending: PendingCall) -> None:
        """Waits for a `launch`ed call; raises `CollectiveMismatchError` (its data
        unused) unless every worker made the same call."""
        self.watch.wait(pending.works, pending.seq, pending.text)
        ledger = self._ledger
        if pending.codec is not None:
            same, guess, miss = self._read(pending.codec, pending.buffer, pending.end,
                                           pending.expected, pending.predicted)
            if not same or miss != 0:
                self.watch.mismatch(pending.seq, pending.text)
            if pending.seq == ledger.seq:  # the latest call: its prediction may stand
                ledger.agreed = ledger.predicted if guess == pending.predicted != 0 else None
        self._done(pending.seq)

    def _miss(self, agreed: Wire, ident: int, row: list[int], seq: int, text: object
              ) -> None:
        """Sends zeros of the ``agreed`` sizes (what every worker predicted this call
        would send) with "miss" set, in the trailer or in the header ``row``: a peer
        that made the predicted call meets them in one collective of the sizes it
        expects, reads the miss, and goes on to a header round, as this worker does."""
        dummy = [torch.zeros(n, dtype=getattr(torch, d.removeprefix("torch.")),
                             device=self._wire.torch_device) for _, d, n in agreed]
        if self._codec(agreed) is not None:
            trailer.write(dummy[0], agreed[0][0], self._world, (ident, 0, 1))
            self.watch.wait(self._launch(agreed, dummy), seq, text)
        else:
            self._round(row, self._launch(agreed, dummy), seq, text)

    def _row(self, ident: int, predicted: int, flag: int, value: int, sizes: Sequence[int],
             miss: int = 0) -> list[int]:
        """This worker's header row (`HEAD` fields, then one size per local replica)."""
        row = [ident, predicted, miss, flag, value, *sizes]
        return row + [0] * (HEAD + self._local_replicas - len(row))

    def _wire_hash(self, wire: Wire) -> int:
        """``identity_hash`` of a predicted call's wire sizes (cached: a loop repeats)."""
        known = self._wire_hashes.get(wire)
        if known is None:
            if len(self._wire_hashes) > 4096:
                self._wire_hashes.clear()
            known = self._wire_hashes[wire] = identity_hash(repr(wire))
        return known

    def _key(self, known: tuple[Any, ...], key: str) -> tuple[str, int]:
        if len(self._keys) > 4096:
            self._keys.clear()
        keyed = self._keys[known] = (key, identity_hash(key))
        return keyed

    def _codec(self, wire: Wire) -> trailer.Codec | None:
        """The trailer codec of a call of these wire sizes (its first pack carries the
        trailer; ``None``: no trailer)."""
        if not wire:
            return None
        try:
            return self._codecs[wire[0]]
        except KeyError:
            pass
        kind, dtype_name, _ = wire[0]
        dtype = getattr(torch, dtype_name.removeprefix("torch."), None)
        codec = (trailer.codec_of(kind, dtype, self._world) if kind in ("sum", "min", "max")
                 and isinstance(dtype, torch.dtype)
                 and trailer.length(kind, dtype, self._world) else None)
        if len(self._codecs) > 4096:
            self._codecs.clear()
        self._codecs[wire[0]] = codec
        return codec

    def _stamp(self, codec: trailer.Codec, buffer: torch.Tensor, ident: int,
               predicted: int, miss: int) -> tuple[int, bytes]:
        """Writes the trailer at the end of ``buffer`` -> (the address where it ends on
        the host, 0 on a device or in a strided view; what the combined trailer holds
        when every worker sent the same)."""
        if self._host and buffer.is_contiguous():  # (a pooled host buffer: `Codec`)
            end = buffer.data_ptr() + buffer.numel() * codec.itemsize
            return end, codec.write_at(end, ident, predicted, miss)
        return 0, trailer.write(buffer, codec.kind, self._world, (ident, predicted, miss))

    def _read(self, codec: trailer.Codec, buffer: torch.Tensor, end: int, expected: bytes,
              predicted: int) -> tuple[bool, int | None, int | None]:
        """The combined trailer of a `_stamp`ed ``buffer`` -> (whether every worker made
        this call, the prediction they share (``None``: they differ), the miss flag).
        Every worker sent this worker's trailer when it holds ``expected`` (one byte
        comparison); only otherwise is it decoded, field by field."""
        if codec.holds_at(end, expected) if end else trailer.holds(buffer, expected):
            return True, predicted, 0
        (same, guess, miss), _ = trailer.decode(buffer[-codec.length:], codec.kind,
                                                self._world)
        return same is not None, guess, miss

    def _done(self, seq: int) -> None:
        self._ledger.completed = seq
        if self._job is not None:  # (started: the latest, launched buckets may follow seq)
            self._job.note_progress(self._ledger.seq, seq)

    def _launch(self, wire: Wire, data: Sequence[torch.Tensor],
                fill: Callable[[int], None] | None = None,
                sources: Sequence[torch.Tensor | None] = ()) -> list[Any]:
        works: list[Any] = []
        for i, ((kind, _, _), buffer) in enumerate(zip(wire, data, strict=True)):
            if kind == "sum" and self._pair is not None and buffer.dtype in EXCHANGED:
                source = sources[i] if sources else None
                if source is None and fill is not None:
                    fill(i)
                works.append(self._pair.sum(buffer, source))
                continue
            if fill is not None:
                fill(i)
            if kind == "broadcast":
                works.append(dist.broadcast(buffer, src=0, group=self._group, async_op=True))
            elif self._direct is not None and not buffer.is_complex():
                # What dist.all_reduce does for a dense tensor outside a coalescing
                # context, less its Python checks (a third of a small call's CPU time).
                works.append(self._direct[0].allreduce([buffer], self._direct[1][kind]))
            else:
                works.append(dist.all_reduce(buffer, op=_DIST_OPS[kind], group=self._group,
                                             async_op=True))
        return works

    def _round(self, row: list[int], works: list[Any], seq: int, text: object
               ) -> list[list[int]]:
        """All-gathers ``row`` (before ``works``' results are awaited) -> the table."""
        header = torch.tensor(row, dtype=torch.int64, device=self._wire.torch_device)
        rows = torch.empty(self._world * len(row), dtype=torch.int64, device=header.device)
        self.watch.wait([self._gather_rows(rows, header), *works], seq, text)
        flat, n = rows.tolist(), len(row)
        return [flat[i:i + n] for i in range(0, len(flat), n)]

    def _gather_rows(self, rows: torch.Tensor, header: torch.Tensor) -> Any:
        """Launches the all-gather of ``header`` into ``rows`` (worker ``w``'s row at
        ``w * len``) -> its work: one flat collective, or the list form into views of
        ``rows`` where the backend lacks the flat one (older torch's Gloo refused it at
        launch with "no support for _allgather_base", before anything was sent, alike
        on every worker)."""
        if self._flat_gather:
            try:
                return _GATHER_INTO(rows, header, group=self._group, async_op=True)
            except RuntimeError as error:
                if "no support" not in str(error):
                    raise
                self._flat_gather = False
        return dist.all_gather(list(rows.view(self._world, -1)), header, group=self._group,
                               async_op=True)

    def _verified(self, table: list[list[int]], seq: int, text: object, *,
                  done: bool = True) -> list[list[int]]:
        ledger = self._ledger
        if any(r[0] != table[0][0] for r in table):
            self.watch.mismatch(seq, text)
        if all(r[1] == table[0][1] for r in table) and table[0][1]:
            ledger.agreed = ledger.predicted
        if done:
            self._done(seq)
        return table


def _direct_all_reduce(group: Any) -> tuple[Any, dict[str, Any]] | None:
    """The process group and an ``AllreduceOptions`` per kind, to launch all-reduces
    without ``dist.all_reduce``'s per-call checks (``None``: this torch lacks them)."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        options = {}
        for kind, op in _DIST_OPS.items():
            opts = dist.AllreduceOptions()
            opts.reduceOp = op  # type: ignore[assignment]  # (as dist.all_reduce does)
            if hasattr(opts, "asyncOp"):
                opts.asyncOp = True
            options[kind] = opts
    except (AttributeError, RuntimeError):
        return None
    return (pg, options) if hasattr(pg, "allreduce") else None


class _CallText:
    """A call's name for messages (``entry(what) at site (collective k in run r)``),
    formatted only when a message needs it: most calls never fail."""

    __slots__ = ("_in_run", "_index", "_run", "_what", "_who")

    def __init__(self, who: UserCall, what: str, index: int, in_run: bool, run: int) -> None:
        self._who, self._what, self._index = who, what, index
        self._in_run, self._run = in_run, run  # (the ledger's, as this call started)

    def __str__(self) -> str:
        return (f"{self._who.entry}({short(self._what)}) at {self._who.site} (collective "
                f"{self._index} {CallLedger.describe_phase(self._in_run, self._run)})")

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class PendingCall:
    """A `CrossWorkerCalls.launch`ed call: its collectives (``works``), the buffer that
    ends with the trailer (``codec``'s; ``None``: none) where ``end`` says (see
    `CrossWorkerCalls._stamp`), and the call's number and name."""

    __slots__ = ("buffer", "codec", "end", "expected", "predicted", "seq", "text", "works")

    def __init__(self, works: list[Any], buffer: torch.Tensor, codec: trailer.Codec | None,
                 end: int, seq: int, text: str, predicted: int, expected: bytes = b"") -> None:
        self.works, self.buffer, self.codec, self.end = works, buffer, codec, end
        self.seq, self.text, self.predicted = seq, text, predicted
        self.expected = expected  # the combined trailer when every worker sent the same
