"""The shared speculation core: modality-free, model-free.

draft -> verify in one target pass -> accept -> commit the KV cache, for chains and trees, with
exact and relaxed acceptance rules, a logits processor with classifier-free guidance, and static
or sink+window rolling caches. Adapters turn model families into its ``Target`` / ``Drafter``.
Continuous tokens run through the same loop: per-position ``TokenDist``s from a
``DensityProcessor`` instead of probabilities (``mmspec.core.distributions``).

The seams (``Target``, ``Drafter`` with ``DrafterBase``'s defaults, ``FeatureHead``, ``ParallelHeads``,
``AcceptanceRule``, ``DecodingSchedule`` -> ``SchedulePlan``, ``KVCache``) are typed in one place,
``mmspec.core.types``; imports inside the core point one way (``tests/test_core_protocols.py``).
"""

from .acceptance import GreedyMatch, SpeculativeSampling
from .cache import SinkWindowCache, SlotKVCache, StaticKVCache
from .decoder import DecodeOutput, DecodeState, Job, Served, SpeculativeDecoder
from .distributions import DensityProcessor, Draw, HeadMeter, Residual, TokenDist
from .lookup import PromptLookupDrafter
from .gate import GatedDrafter, SpeedGate
from .drafters import (EagleTreeDrafter, JacobiDensityDrafter, JacobiDrafter, ModelChainDrafter, ModelTreeDrafter,
                       NullDrafter, ParallelHeadsDrafter)
from .logits import LogitsProcessor
from .relaxed import (CSpDAcceptance, GroupedAcceptance, GroupedAcceptanceConfig, LatentProximityAcceptance,
                      LatentProximityConfig, latent_neighbours)
from .schedule import NextSetSchedule, RasterSchedule
from .stats import Stats
from .tree import DraftTree, Tree, dynamic_tree, sampled_tree
from .types import (Acceptance, AcceptanceRule, DecodingSchedule, Drafter, DrafterBase, FeatureHead, KVCache,
                    ModelOutput, ParallelHeads, SchedulePlan, Target, TokenHead)

__all__ = [
    "Acceptance", "AcceptanceRule", "CSpDAcceptance", "DecodeOutput", "DecodeState", "DecodingSchedule", "DensityProcessor", "Draw",
    "DraftTree", "Drafter", "DrafterBase", "EagleTreeDrafter", "FeatureHead", "GatedDrafter", "GreedyMatch",
    "HeadMeter", "GroupedAcceptance", "GroupedAcceptanceConfig", "JacobiDensityDrafter", "JacobiDrafter", "Job",
    "KVCache", "LatentProximityAcceptance",
    "LatentProximityConfig", "LogitsProcessor", "ModelChainDrafter", "ModelOutput", "ModelTreeDrafter",
    "NextSetSchedule", "NullDrafter", "ParallelHeads", "ParallelHeadsDrafter", "PromptLookupDrafter",
    "RasterSchedule", "Residual", "SchedulePlan", "Served",
    "SinkWindowCache", "SlotKVCache", "SpeculativeDecoder", "SpeedGate",
    "SpeculativeSampling", "StaticKVCache", "Stats", "Target", "TokenDist", "TokenHead", "Tree", "dynamic_tree",
    "latent_neighbours", "sampled_tree",
]
