"""The saved state, typed: :class:`ResumeState` and its plain form.

``state_dict()`` returns :meth:`ResumeState.to_dict`: ints, strings, bools, lists and
dicts only, so ``json.dumps`` takes it and ``torch.load(weights_only=True)`` reads it
back (a dataset's or sampler's own state is kept as it gave it). RNG states travel as
base64 strings of their bytes, Python's ``random`` state as lists. ``load_state_dict()``
reads it back through :meth:`ResumeState.from_dict`, the one place a state is checked:
its format, its version (this dpex also reads version 1, whose RNG states were
tensors) and each key's type. The keys are described in docs/RESUME.md.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import torch

from dpex._spec import FINISH_EPOCH, restores_dataset
from dpex.client.resume._reshard import Layout
from dpex.errors import ResumeStateError

__all__ = ["FORMAT", "STATE_VERSION", "ResumeState", "rng_from_plain", "rng_to_plain"]

FORMAT = "dpex.DpexDataLoader"
STATE_VERSION = 2
_READS = (1, 2)  # version 1: RNG states as tensors, no "drawn" (its epochs had drawn)
# Keys version 1 gained over its life (a state of an earlier dpex lacks them), as read then.
_VERSION_1_DEFAULTS = {"rank": 0, "world_size": 1, "identity": None, "sampler_epoch": None}
_RNG_FIELDS = ("sampler_rng", "base_rng", "sampler_draw_rng", "iterator_rng", "global_rng")


def rng_to_plain(state: torch.Tensor | None) -> str | None:
    """A generator's state (a byte tensor) as a base64 string."""
    if state is None:
        return None
    return base64.b64encode(state.contiguous().numpy().tobytes()).decode("ascii")


def rng_from_plain(plain: Any, dtype: torch.dtype = torch.uint8) -> torch.Tensor | None:
    """The tensor :func:`rng_to_plain` encoded (a version-1 state's tensor as it is)."""
    if plain is None or isinstance(plain, torch.Tensor):
        return plain
    if isinstance(plain, list):  # (a list of the bytes is read as well)
        return torch.tensor(plain, dtype=dtype)
    return torch.frombuffer(bytearray(base64.b64decode(plain)), dtype=dtype).clone()


# A worker's RNG states (``server._rng.RngRecorder.capture``, beside its dataset's own
# states, which stay as the dataset gave them): each part's way to plain data and back.
_WORKER_RNG_PARTS = {
    "torch": (rng_to_plain, rng_from_plain),
    "random": (lambda s: [s[0], list(s[1]), s[2]],  # (version, 625 words, gauss)
               lambda p: (p[0], tuple(p[1]), p[2])),
    "numpy": (lambda s: [s[0], rng_to_plain(s[1]), *s[2:]],  # (kind, keys, pos, ...)
              lambda p: (p[0], rng_from_plain(p[1], torch.int32), *p[2:])),
}


def _worker_rng(rng: dict | None, direction: int) -> dict | None:
    """``rng`` with each RNG part made plain (direction 0) or read back (1)."""
    if rng is None:
        return None
    return {key: _WORKER_RNG_PARTS[key][direction](value) if key in _WORKER_RNG_PARTS
            else value for key, value in rng.items()}


def _int_keys(mapping: dict | None) -> dict | None:
    """JSON gives a dict's int keys back as strings: worker ids are ints again."""
    return None if mapping is None else {int(k): v for k, v in mapping.items()}


_OPTIONAL_INT = (int, type(None))
_TYPES: dict[str, tuple[type, ...]] = {  # what from_dict accepts for each key
    "rng_source": (str,), "base_rng_source": (str,), "num_workers": (int,),
    "rank": (int,), "world_size": (int,), "identity": (dict, type(None)),
    "length": _OPTIONAL_INT, "sampler_epoch": _OPTIONAL_INT, "mid_epoch": (bool,),
    "yielded": (int,), "drawn": (bool,), "layout": (dict, type(None)),
    "worker_rng": (dict, type(None)), "worker_rng_num_workers": (int,),
    "iterable": (dict, type(None)), "epochs_before": (int,),
    **{name: (str, list, torch.Tensor, type(None)) for name in _RNG_FIELDS},
}


@dataclasses.dataclass
class ResumeState:
    """Where a loader stood, and what that position depends on (docs/RESUME.md).

    In memory RNG states are tensors and a worker's are as its recorder took them;
    :meth:`to_dict` makes the plain form, :meth:`from_dict` reads it (and checks it).
    """

    # What the position belongs to: checked against the loader that loads it.
    rng_source: str  # what the sampler draws from: "generator" or "global"
    base_rng_source: str  # what the base seed is drawn from: the same two
    num_workers: int
    rank: int
    world_size: int
    identity: dict | None  # the sampler, batching and dataset length (_identity.py)
    length: int | None  # batches per epoch of a map-style loader
    sampler_epoch: int | None  # a DistributedSampler's epoch (set_epoch)
    # Where in the epoch.
    mid_epoch: bool = False
    yielded: int = 0  # batches of this epoch yielded
    drawn: bool = True  # the epoch's first index batch was drawn (else: iter(), no next())
    layout: dict | None = None  # how torch's DistributedSampler dealt the epoch (_reshard)
    # The generators: the sampler's when the epoch began and at its first draw, the
    # loader's (base seeds) and torch's global one, between epochs where they are drawn from.
    sampler_rng: torch.Tensor | None = None
    base_rng: torch.Tensor | None = None
    sampler_draw_rng: torch.Tensor | None = None
    iterator_rng: torch.Tensor | None = None  # the running iterator's base seed's source
    global_rng: torch.Tensor | None = None
    sampler_state: Any = None  # a stateful sampler's own state_dict()
    # dpex's workers: each one's RNG (and dataset) states after its last batch taken.
    worker_rng: dict[int, dict | None] | None = None
    worker_rng_num_workers: int = 0
    iterable: dict | None = None  # an IterableDataset's position in each worker's shard
    epochs_before: int = 0  # epochs a persistent iterator's base seed served before
    # num_workers=0: the dataset's own state and its iterator's (torchdata's order:
    # the dataset's, then iter(), then the iterator's).
    dataset: Any = None
    dataset_iter: Any = None
    # In memory only, on a loaded state (load_state_dict): resuming on another number of
    # ranks (or another batch size), the rest of the saved epoch as this rank's
    # DistributedSampler deals it (_reshard.py); None: replayed as the saved run drew it.
    rest: Layout | None = dataclasses.field(default=None, metadata={"plain": False})

    def worker_rng_fits(self, num_workers: int) -> bool:
        """Whether the saved workers' RNG states apply: with another worker count each
        worker computes other batches, so fresh seeds are as good as any."""
        return self.worker_rng is not None and num_workers == self.worker_rng_num_workers

    def between_epochs(self) -> ResumeState:
        """This state with each worker's dataset state marked as taken between epochs:
        the resumed worker runs what was left of that epoch (nothing but its end) first,
        as torchdata's workers do (a dataset that counts its epochs counts then)."""
        if self.mid_epoch or not self.worker_rng:
            return self
        return dataclasses.replace(self, worker_rng={
            w: {**rng, FINISH_EPOCH: True} if restores_dataset(rng) else rng
            for w, rng in self.worker_rng.items()})

    def to_dict(self) -> dict:
        """The plain form ``state_dict()`` returns."""
        plain: dict[str, Any] = {"format": FORMAT, "version": STATE_VERSION}
        for field in _plain_fields():
            plain[field.name] = getattr(self, field.name)
        for name in _RNG_FIELDS:
            plain[name] = rng_to_plain(plain[name])
        if self.worker_rng is not None:
            plain["worker_rng"] = {w: _worker_rng(rng, 0)
                                   for w, rng in self.worker_rng.items()}
        return plain

    @classmethod
    def from_dict(cls, plain: Any) -> ResumeState:
        """Check ``plain`` (what ``state_dict()`` returned, maybe through JSON or
        ``torch.load``) and read it; a :class:`~dpex.ResumeStateError` names what is wrong."""
        if not isinstance(plain, dict) or plain.get("format") != FORMAT:
            raise ResumeStateError(
                "load_state_dict() takes what DpexDataLoader.state_dict() returned; got "
                f"{type(plain).__name__}" + (f" with keys {sorted(plain)[:8]}"
                                             if isinstance(plain, dict) else ""))
        if plain.get("version") not in _READS:
            raise ResumeStateError(
                f"this loader state has version {plain.get('version')!r}; this dpex reads "
                f"versions {', '.join(map(str, _READS))}: resume with the dpex version that "
                "saved it")
        if plain["version"] == 1:
            plain = {**_VERSION_1_DEFAULTS, **plain}
            if not isinstance(plain["sampler_epoch"], int):  # (a float epoch was saved too)
                plain["sampler_epoch"] = None
        values = {f.name: plain[f.name] for f in _plain_fields() if f.name in plain}
        missing = [f.name for f in _plain_fields() if f.name not in plain
                   and f.default is dataclasses.MISSING]
        if missing:
            raise ResumeStateError(f"this loader state lacks {missing}: it is incomplete")
        for name, value in values.items():
            types = _TYPES.get(name)
            if types is not None and not isinstance(value, types) or (
                    types == (int,) and isinstance(value, bool)):
                raise ResumeStateError(
                    f"this loader state's {name!r} is {type(value).__name__} {value!r:.60}; "
                    f"expected {' or '.join(t.__name__ for t in types)}")
        _check_counts(values)
        state = cls(**values)
        name = ""
        try:  # the nested fields: what they hold is named, not a raw TypeError / KeyError
            for name in _RNG_FIELDS:  # (a sampler's generator may be on a device)
                setattr(state, name, _checked_rng(rng_from_plain(getattr(state, name)),
                                                  cpu=not name.startswith("sampler")))
            name = "worker_rng"
            if state.worker_rng is not None:
                state.worker_rng = {w: _checked_worker_rng(_worker_rng(rng, 1))
                                    for w, rng in _int_keys(state.worker_rng).items()}
            name = "iterable"
            if state.iterable is not None and "workers" in state.iterable:
                state.iterable = {**state.iterable,
                                  "workers": _int_keys(state.iterable["workers"])}
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ResumeStateError(f"this loader state's {name!r} cannot be read: "
                                   f"{type(exc).__name__}: {exc}") from None
        return state


def _plain_fields() -> list[dataclasses.Field]:
    """The fields a plain state holds (not the in-memory ``rest``)."""
    return [f for f in dataclasses.fields(ResumeState) if f.metadata.get("plain", True)]


_COUNTS = {"yielded": 0, "num_workers": 0, "rank": 0, "world_size": 1, "length": 0,
           "worker_rng_num_workers": 0, "epochs_before": 0}  # the least each may be
_TORCH_RNG_BYTES = torch.Generator().get_state().numel()  # (the CPU generator's)


def _check_counts(values: dict) -> None:
    for name, least in _COUNTS.items():
        value = values.get(name)
        if value is not None and value < least:
            raise ResumeStateError(f"this loader state's {name!r} is {value}; it is at "
                                   f"least {least}")


def _checked_rng(state: torch.Tensor | None, cpu: bool = True) -> torch.Tensor | None:
    """A torch generator's state, refused now (not at the next ``iter()``) if it is not
    one of this torch's CPU generator's (``cpu``; else any generator's: bytes)."""
    if state is not None and (state.dtype != torch.uint8 or not state.numel() or (
            cpu and state.numel() != _TORCH_RNG_BYTES)):
        raise ValueError(f"a generator state of {state.numel()} {state.dtype} values; "
                         f"torch's holds {_TORCH_RNG_BYTES} bytes")
    return state


def _checked_worker_rng(rng: dict | None) -> dict | None:
    if rng is not None:
        _checked_rng(rng.get("torch"))
        if "random" in rng and len(rng["random"][1]) != 625:
            raise ValueError(f"Python's random state holds {len(rng['random'][1])} words, "
                             "not 625")
        if "numpy" in rng and rng["numpy"][1].numel() != 624:
            raise ValueError(f"NumPy's state holds {rng['numpy'][1].numel()} keys, not 624")
    return rng
