"""Resuming with ``num_workers=0``: the dataset runs in the trainer, in torch's
single-process iterator. Its own state (map-style datasets too) and, mid-epoch, its
iterator's are saved, and put back in torchdata's order; an IterableDataset with
neither passes over the batches already yielded."""

from __future__ import annotations

import logging
from typing import Any

from dpex._spec import own_state
from dpex.client.resume._position import fetcher_of
from dpex.client.resume._state import ResumeState
from dpex.client.resume._view import LoaderView

__all__ = ["in_trainer", "trainer_states"]

logger = logging.getLogger("dpex")


def trainer_states(view: LoaderView, fetcher: Any, mid_epoch: bool) -> dict:
    """num_workers=0: the dataset's own state (map-style datasets too: one that keeps
    its RNG there, say) and, in the middle of an IterableDataset's epoch, its
    iterator's. A dataset that is its own iterator has only the iterator's, which
    means nothing once its epoch ended (torchdata's rules)."""
    dataset = view.dataset
    if not view.iterable:
        return {"dataset": own_state(dataset)}
    dataset_iter = getattr(fetcher, "dataset_iter", None)
    if dataset_iter is None:  # never iterated: the dataset is as it was made
        return {}
    states = {"dataset": None if dataset_iter is dataset else own_state(dataset)}
    if mid_epoch:
        states["dataset_iter"] = own_state(dataset_iter)
    return states


def _loading_first(fetcher: Any, dataset: Any, state: Any) -> Any:
    fetch = fetcher.fetch

    def loading_first(index: Any) -> Any:
        fetcher.fetch = fetch
        dataset.load_state_dict(state)
        return fetch(index)

    return loading_first


def _noting_the_end(fetcher: Any) -> Any:
    """torch's fetcher of an IterableDataset, whose ``ended`` also says when a dataset
    ended without a partial batch (the epoch ended: ``state_dict()`` is between epochs)."""
    fetch = fetcher.fetch

    def noting_the_end(index: Any) -> Any:
        try:
            return fetch(index)
        except StopIteration:
            fetcher.ended = True
            raise

    return noting_the_end


def in_trainer(view: LoaderView, resume: ResumeState | None, make: Any) -> Any:
    """num_workers=0: make torch's single-process iterator with ``make()`` where the
    loaded state ``resume`` (or None) says the saved run stood, in torchdata's order:
    the dataset's own state is loaded, then ``iter()``, then its iterator's own state;
    an IterableDataset with no state of its own passes over the batches already
    yielded (fetched again and dropped: it cannot skip them otherwise)."""
    if resume is not None and resume.dataset is not None and (
            view.iterable or not resume.mid_epoch):
        view.dataset.load_state_dict(resume.dataset)
    iterator = make()
    fetcher = fetcher_of(iterator)
    if not view.iterable:
        if resume is not None and resume.mid_epoch and resume.dataset is not None:
            if resume.drawn:
                # In the middle of an epoch: loaded after the epoch's first draw (its
                # replay), right before the first fetch, where the saved run's dataset
                # stood when it saved it (a dataset that keeps torch's RNG in its state).
                fetcher.fetch = _loading_first(fetcher, view.dataset, resume.dataset)
            else:  # saved before the epoch's first draw: that draw is still to come
                view.dataset.load_state_dict(resume.dataset)
        return iterator
    fetcher.fetch = _noting_the_end(fetcher)
    if resume is None or not resume.mid_epoch:
        return iterator
    if resume.dataset_iter is not None:
        fetcher.dataset_iter.load_state_dict(resume.dataset_iter)
    elif resume.dataset is None and resume.yielded:
        _pass_over(view, fetcher, resume.yielded)
    if (resume.iterable or {}).get("trainer", {}).get("ended"):
        fetcher.ended = True
    return iterator


def _pass_over(view: LoaderView, fetcher: Any, skip: int) -> None:
    indices = iter(view.index_sampler)
    logger.info("dpex: the IterableDataset keeps no state of its own: passing over the "
                "%d batches already yielded", skip)
    for _ in range(skip):
        try:
            fetcher.fetch(next(indices))
        except StopIteration:
            break
