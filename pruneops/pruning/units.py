"""Prunable units of a model and their physical removal.

A unit is either a channel group found by Torch-Pruning's dependency graph (named by its root
layer; coupled layers across residual adds, BatchNorm, concatenation and flatten are pruned
together) or the heads of an attention module (named `<module>.heads`; heads that several layers
must lose together, as MPNet's, form one unit named after the module that ties them). The
classifier's outputs and attention projections are never pruned as channels, and a model whose
attention layers share weights (ALBERT) is refused.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch_pruning as tp
from torch import nn

from pruneops.core.errors import PruneOpsError
from pruneops.models import classifier_of
from pruneops.pruning.heads import (
    HeadSite,
    HeadTie,
    head_sites,
    head_ties,
    refuse_shared_attention,
    remove_heads_,
    remove_tied_heads_,
)
from pruneops.pruning.importance import IMPORTANCES, Criterion

ROOT_TYPES = (nn.Conv1d, nn.Conv2d, nn.Linear)


@dataclass(frozen=True)
class UnitInfo:
    """One prunable unit: `kind` is "channels" or "heads"; `size` its current count."""

    name: str
    kind: str
    size: int


def ignored_layers(model: nn.Module) -> list[nn.Module]:
    """Layers whose output channels are never pruned: the classifier and attention projections."""
    ignored = [classifier_of(model)]
    for site in head_sites(model).values():
        ignored += [*site.projections, site.out]
    return ignored


HEAD_UNIT = "heads"  # a root-level tie's head unit; others are "<attention module>.heads"


def is_head_unit(name: str) -> bool:
    """Whether a unit name (as `UnitPruner.units` names them) is a head unit, not a channel unit."""
    return name == HEAD_UNIT or name.endswith(f".{HEAD_UNIT}")


def round_keep(size: int, ratio: float, round_to: int | None) -> int:
    """How many of `size` units to keep after removing `ratio` of them (at least one)."""
    keep = size - int(round(size * ratio))
    if round_to:
        keep = int(round(keep / round_to)) * round_to
        keep = max(keep, min(round_to, size))
    return max(1, min(size, keep))


def keep_count(name: str, size: int, ratio: float, round_to: int | None) -> int:
    """How many of unit `name`'s `size` channels or heads a method keeps at `ratio`.

    Channel counts snap to `round_to` (fast sizes for the kernels); head counts never do: rounding
    12 heads at half to 8 keeps 8, not 6, and a head is not a channel the kernels tile.
    """
    return round_keep(size, ratio, None if is_head_unit(name) else round_to)


class UnitPruner:
    """Lists and prunes the units of `model`; the dependency graph is rebuilt per call.

    Args:
        model: The model, pruned in place.
        example_input: A batch the model accepts, to trace dependencies.
        criterion: How to rank channels and heads.
    """

    def __init__(self, model: nn.Module, example_input: torch.Tensor, criterion: Criterion):
        self.model = model
        self.example_input = example_input
        self.criterion = criterion
        # What could not be done as configured (e.g. a criterion that cannot score a unit).
        self.warnings: list[str] = []

    def _graph(self) -> tp.DependencyGraph:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tp.DependencyGraph().build_dependency(self.model, example_inputs=self.example_input)

    def _groups(self, graph: tp.DependencyGraph):
        names = {m: n for n, m in self.model.named_modules()}
        # Torch-Pruning leaves a concatenation unmapped when it cannot infer the channel split
        # (e.g. its output is flattened straight into a Linear); pruning through it would remove
        # the wrong channels, so groups that cross one are left alone.
        unmapped = {
            node
            for node in graph.module2node.values()
            if node.type == tp.ops.OPTYPE.CONCAT and getattr(node.module, "offsets", None) is None
        }
        for group in graph.get_all_groups(ignored_layers=ignored_layers(self.model), root_module_types=ROOT_TYPES):
            if any(item.dep.source in unmapped or item.dep.target in unmapped for item in group):
                continue
            yield names[group[0].dep.target.module], group

    def _run(self) -> object:
        x = self.example_input
        return self.model(**x) if isinstance(x, dict) else self.model(x)

    def _head_units(self) -> tuple[dict[str, HeadSite], dict[str, tuple[tuple[str, ...], HeadTie | None]]]:
        """The attention sites, and per head unit the sites it prunes together and what ties them.

        Raises:
            PruneOpsError: Attention no adapter understands, or attention shared by several layers.
        """
        sites = head_sites(self.model)
        if not sites:
            return sites, {}
        refuse_shared_attention(self.model, sites, self._run)
        ties = head_ties(self.model, sites)
        tied = {s for tie in ties.values() for s in tie.sites}
        units: dict[str, tuple[tuple[str, ...], HeadTie | None]] = {
            f"{n}.{HEAD_UNIT}": ((n,), None) for n in sites if n not in tied
        }
        units.update({f"{n}.{HEAD_UNIT}" if n else HEAD_UNIT: (tie.sites, tie) for n, tie in ties.items()})
        return sites, units

    def head_unit_members(self) -> dict[str, tuple[str, ...]]:
        """Per head unit, the attention sites it prunes together (one, or the layers a tie binds)."""
        return {unit: members for unit, (members, _) in self._head_units()[1].items()}

    def units(self) -> dict[str, UnitInfo]:
        """Every prunable unit, by name."""
        found = {name: UnitInfo(name, "channels", len(group[0].idxs)) for name, group in self._groups(self._graph())}
        sites, head_units = self._head_units()
        for unit, (members, _) in head_units.items():
            found[unit] = UnitInfo(unit, "heads", sites[members[0]].num_heads)
        return found

    def linear_consumers(self) -> dict[str, nn.Linear]:
        """Per channel unit, the Linear that takes its channels as inputs (e.g. an FFN's second Linear).

        A unit without one (channels that feed a convolution) is left out.
        """
        found = {}
        for name, group in self._groups(self._graph()):
            size = len(group[0].idxs)
            for item in group[1:]:
                module = item.dep.target.module
                handler = item.dep.handler
                if (
                    isinstance(module, nn.Linear)
                    and handler == tp.prune_linear_in_channels
                    and module.in_features == size
                ):
                    found[name] = module
                    break
        return found

    def prune_to_(
        self,
        keep: dict[str, int],
        head_scores: dict[str, torch.Tensor] | None = None,
        channel_scores: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Removes the least important channels/heads so each named unit keeps `keep[name]`.

        Args:
            keep: Units to shrink and how many channels/heads each keeps.
            head_scores: Per attention module name, precomputed head importance (e.g. the gate
                importance); otherwise heads are ranked by the criterion over their weights.
            channel_scores: Per channel unit, precomputed channel importance (higher = kept);
                units without one are ranked by the criterion.
        """
        self._prune_heads_(keep, head_scores or {})
        wanted = {n: k for n, k in keep.items() if not is_head_unit(n)}
        if not wanted:
            return
        graph = self._graph()
        importance = self.criterion.make_group_importance()
        for name, group in self._groups(graph):
            size = len(group[0].idxs)
            k = wanted.get(name)
            if k is None or k >= size:
                continue
            scores = (channel_scores or {}).get(name)
            if scores is None:
                scores = self._group_scores(name, group, importance)
            drop = torch.argsort(scores)[: size - k].tolist()
            dep = group[0].dep
            graph.get_pruning_group(dep.target.module, dep.handler, idxs=drop).prune()

    def _prune_heads_(self, keep: dict[str, int], head_scores: dict[str, torch.Tensor]) -> None:
        sites, head_units = self._head_units()
        for unit, (members, tie) in head_units.items():
            size = sites[members[0]].num_heads
            k = keep.get(unit)
            if k is None or k >= size:
                continue
            # Tied layers lose the same heads: a head's score is its summed score over them.
            scores = sum(self._head_scores(name, sites[name], head_scores) for name in members)
            drop = torch.argsort(scores)[: size - k].tolist()
            if tie is None:
                remove_heads_(sites[members[0]], drop)
            else:
                remove_tied_heads_(tie, sites, drop)

    def _head_scores(self, name: str, site: HeadSite, precomputed: dict[str, torch.Tensor]) -> torch.Tensor:
        if name in precomputed:
            return precomputed[name]
        if not self.criterion.scores_heads:
            self._warn(f"importance {self.criterion.name!r} cannot score the heads of {name}: ranked by L2")
        return self.criterion.head_scores(site.head_matrix(), site.head_matrix(grad=True))

    def scores(self, unit: str) -> torch.Tensor:
        """The criterion's score of each channel of a channel unit (higher = more important)."""
        graph = self._graph()
        for name, group in self._groups(graph):
            if name == unit:
                return self._group_scores(name, group, self.criterion.make_group_importance())
        raise KeyError(f"no channel unit {unit!r}")

    @torch.no_grad()
    def _group_scores(self, name: str, group, importance) -> torch.Tensor:
        """Scores of one channel group; a criterion that cannot score it is said, not swapped quietly.

        Raises:
            PruneOpsError: A gradient criterion found a layer of the group without gradients.
        """
        try:
            scores = importance(group)
        except AttributeError:  # Torch-Pruning reads `.grad.data` of every layer in the group
            if self.criterion.needs_grad:
                raise PruneOpsError(
                    f"importance {self.criterion.name!r} cannot score unit {name}: a layer of it has no "
                    "gradient (compute gradients on this model before pruning)"
                ) from None
            raise
        if scores is None:  # e.g. BN-scale on a group without BatchNorm
            self._warn(
                f"importance {self.criterion.name!r} cannot score unit {name} "
                "(no layer it understands): ranked by L2 norm instead"
            )
            scores = tp.importance.GroupMagnitudeImportance(p=2)(group)
        return scores

    def _warn(self, warning: str) -> None:
        if warning not in self.warnings:
            self.warnings.append(warning)


def unit_sizes(model: nn.Module, example: torch.Tensor) -> dict[str, int]:
    """Each prunable unit's full width (channels, or heads for an attention unit)."""
    return {n: u.size for n, u in UnitPruner(model, example, IMPORTANCES.get("l2")).units().items()}
