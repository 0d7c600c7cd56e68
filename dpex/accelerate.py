"""dpex with HF Accelerate, and so with ``transformers.Trainer``.

``Accelerator.prepare()`` rebuilds every DataLoader, subclasses included, as a
plain torch ``DataLoader`` inside its own ``DataLoaderShard`` (or
``DataLoaderDispatcher``), so a DpexDataLoader passed to it loses its Ray workers
(dpex warns when that happens: :class:`~dpex.DpexDroppedWarning`). This module is
the supported way to keep them: Accelerate prepares the loader as usual (per-rank
sharding, device placement, RNG synchronisation, gradient-accumulation and
``gather_for_metrics`` bookkeeping, ``set_epoch``), then a DpexDataLoader with the
very same dataset, sampler and arguments takes the place of the plain loader it
wraps::

    from dpex.accelerate import prepare_data_loader

    model, optimizer = accelerator.prepare(model, optimizer)
    loader = prepare_data_loader(accelerator, DpexDataLoader(ds, ..., distribute_mode=True))

For ``transformers.Trainer``, convert the loaders it prepares itself::

    class DpexTrainer(Trainer):
        def get_train_dataloader(self):
            return prepare_data_loader(self.accelerator, super().get_train_dataloader())

        def get_eval_dataloader(self, eval_dataset=None):
            return prepare_data_loader(self.accelerator,
                                       super().get_eval_dataloader(eval_dataset))
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dpex.dataloader import DpexDataLoader
from dpex.errors import UnsupportedError

__all__ = ["prepare_data_loader"]


def _is_prepared(loader: Any) -> bool:
    """Whether ``loader`` is Accelerate's adapter (which claims the class of the loader
    it wraps through ``__class__``, so the real type is asked)."""
    try:
        from accelerate.data_loader import DataLoaderAdapter
    except ImportError as exc:
        raise UnsupportedError("dpex.accelerate needs accelerate >= 1.0 (its DataLoaderAdapter), "
                        f"which cannot be imported here: {exc}") from exc
    return issubclass(type(loader), DataLoaderAdapter)


def prepare_data_loader(accelerator: Any, loader: Any, **dpex_arguments: Any) -> Any:
    """Accelerate's prepared loader for ``loader``, with its batches made by dpex workers.

    ``loader`` is a DpexDataLoader (its dpex arguments are kept), a plain torch
    DataLoader, or a loader Accelerate has prepared already (what
    ``transformers.Trainer.get_train_dataloader()`` returns). ``dpex_arguments``
    override dpex's keyword arguments; ``distribute_mode`` defaults to ``True`` unless
    the loader is a DpexDataLoader. The result is what ``accelerator.prepare_data_loader``
    returns, registered with ``accelerator`` (so ``save_state`` and the
    gradient-accumulation state see it); ``accelerator.prepare`` returns it untouched.
    """
    if _is_prepared(loader):
        prepared = loader
    else:
        if isinstance(loader, DpexDataLoader):
            dpex_arguments = {**dataclasses.asdict(loader.dpex_config), **dpex_arguments}
            loader.__dict__["_dpex_preparing"] = True  # no "dpex is dropped" warning
        try:
            prepared = accelerator.prepare_data_loader(loader)
        finally:
            loader.__dict__.pop("_dpex_preparing", None)
    base = prepared.base_dataloader
    if type(base).__module__.startswith("torchdata"):
        raise UnsupportedError(
            "Accelerate was set to use torchdata's StatefulDataLoader "
            "(use_stateful_dataloader=True), which dpex cannot stand in for yet; use "
            "DataLoaderConfiguration(use_stateful_dataloader=False)")
    if isinstance(base, DpexDataLoader):
        base.close()  # replaced below by its twin, with dpex_arguments applied
    elif "distribute_mode" not in dpex_arguments:
        dpex_arguments["distribute_mode"] = True
    prepared.base_dataloader = DpexDataLoader.from_loader(base, **dpex_arguments)
    prepared._is_accelerate_prepared = True
    _carry_state(prepared)
    return prepared


def _carry_state(prepared: Any) -> None:
    """Make ``accelerator.save_state`` / ``load_state`` carry the loader's position.

    Accelerate saves and loads a prepared loader's ``state_dict()`` only when it says
    ``use_stateful_dataloader`` (torchdata's loader, which dpex's stands in for here).
    Its adapter reads the base loader one batch ahead and takes the base loader's
    state before every inner ``next()``; dpex keeps a cheap position there instead
    (no round trip to the workers per batch) and builds the state when it is saved.
    """
    base: DpexDataLoader = prepared.base_dataloader
    prepared.use_stateful_dataloader = True
    position = [base._resume_position()]  # (the latest, taken before each inner next())

    def update() -> None:
        position[0] = base._resume_position()

    def state_dict() -> dict:
        return position[0].state()

    def load_state_dict(state: dict) -> None:
        base.load_state_dict(state)
        update()

    prepared._update_state_dict = update
    prepared.state_dict = state_dict
    prepared.load_state_dict = load_state_dict
    update()
