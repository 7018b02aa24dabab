"""One Mesh (hpsft/utils/distributed.py) lays out every run's ranks: DP x PP x TP x SP, EP for
the experts. Its groups are Megatron-Core's (its RankGenerator, order "tp-cp-ep-dp-pp", SP as
CP: an independent reference, so a Megatron-Core engine and hpsft's counting agree), and its
counting rules (which rank reports a share, the loss-token divisor, who loads data) hold on
every layout."""

import itertools

import pytest

from hpsft.utils.distributed import Mesh
from hpsft.utils.errors import UserInputError

# (dp, pp, tp, sp, ep): every dimension above 1 somewhere, uneven sizes, EP over DP x SP.
LAYOUTS = [(2, 2, 2, 2, 2), (4, 1, 2, 1, 2), (1, 2, 1, 4, 4), (3, 2, 2, 1, 3), (2, 3, 1, 2, 4), (1, 1, 4, 1, 1),
           (6, 1, 1, 1, 3)]
DIMS = [("tp",), ("sp",), ("dp",), ("pp",), ("dp", "sp"), ("tp", "sp"), ("tp", "pp"), ("tp", "sp", "dp")]
MCORE_NAMES = {"tp": "tp", "sp": "cp", "dp": "dp", "pp": "pp"}


@pytest.mark.parametrize("dp, pp, tp, sp, ep", LAYOUTS)
def test_the_mesh_groups_are_megatron_cores(dp, pp, tp, sp, ep):
    """Every group kind and the expert-parallel groups equal Megatron-Core 0.19's RankGenerator's
    (dense: tp, cp, dp, pp as laid out by initialize_model_parallel; experts: its expert
    generator with the expert tensor-parallel size TP and expert data-parallel size DP x SP / EP),
    and each rank's coordinates are its place in those groups.
    Planted: the rank order with DP faster than SP (dp_rank = rank // TP % DP, sp_rank above it):
    test_the_mesh_groups_are_megatron_cores[2-2-2-2-2] failed on the sp groups ([[0, 4], ...] vs
    [[0, 2], ...]); the expert groups as runs of EP consecutive ranks (not TP apart): failed on
    every layout with TP > 1 and EP > 1 ([2-2-2-2-2], [4-1-2-1-2], [3-2-2-1-3])."""
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    mesh = Mesh(dp_size=dp, tp_size=tp, sp_size=sp, pp_size=pp, ep_size=ep)
    dense = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=sp, order="tp-cp-ep-dp-pp")
    for dims in DIMS:
        theirs = sorted(sorted(group) for group in dense.get_ranks("-".join(MCORE_NAMES[d] for d in dims)))
        assert mesh.groups(*dims) == theirs, dims
    experts = parallel_state.RankGenerator(tp=tp, ep=ep, dp=dp * sp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    assert mesh.expert_parallel_ranks() == sorted(sorted(group) for group in experts.get_ranks("ep"))
    for dim, attribute in (("tp", "tp_rank"), ("sp", "sp_rank"), ("dp", "dp_rank"), ("pp", "pp_rank")):
        for group in mesh.groups(dim):
            assert [getattr(mesh.at(rank), attribute) for rank in group] == list(range(len(group))), dim
    for group in mesh.expert_parallel_ranks():
        assert [mesh.at(rank).ep_rank for rank in group] == list(range(ep))


@pytest.mark.parametrize("dp, pp, tp, sp, ep", LAYOUTS)
def test_each_replica_reports_its_share_once_and_the_loss_tokens_divide_out(dp, pp, tp, sp, ep):
    """Every rank of a replica (one DP rank's TP x SP x PP ranks) gets the same rows: of each of
    its TP x PP groups (one SP slice) exactly one rank reports, TP rank 0 on the last stage,
    where the loss is; so each SP slice's share is counted once. The all-reduced loss tokens
    (every rank counting its replica's rows) divided by replica_size are the global count; every
    DP rank loads its part, a driver (rank None) all of it.
    Planted: reports_counts on the first pipeline stage: failed on every layout with PP > 1;
    replica_size TP x SP (the count before PP): failed there too."""
    mesh = Mesh(dp_size=dp, tp_size=tp, sp_size=sp, pp_size=pp, ep_size=ep)
    rows_of_replica = {d: 10 + d for d in range(dp)}  # each DP rank's loss tokens
    summed = sum(rows_of_replica[mesh.at(rank).dp_rank] for rank in range(mesh.world_size))
    assert summed // mesh.replica_size == sum(rows_of_replica.values())
    for d, s in itertools.product(range(dp), range(sp)):
        reporting = [rank for rank in range(mesh.world_size)
                     if (mesh.at(rank).dp_rank, mesh.at(rank).sp_rank) == (d, s) and mesh.at(rank).reports_counts]
        assert len(reporting) == 1
        assert (mesh.at(reporting[0]).tp_rank, mesh.at(reporting[0]).pp_rank) == (0, pp - 1)
    assert [(mesh.at(rank).data_part, mesh.at(rank).loading_ranks) for rank in range(mesh.world_size)] == [
        (mesh.at(rank).dp_rank, dp) for rank in range(mesh.world_size)]
    driver = mesh.at(None)
    assert (driver.data_part, driver.loading_ranks) == (0, 1)
    assert mesh.weight_replicas == dp * sp and mesh.world_size == dp * pp * tp * sp


def test_a_layout_the_world_cannot_hold_is_refused_naming_the_keys():
    """The model-parallel sizes must divide the world, and EP the DP x SP ranks of a stage
    (Megatron-Core's TP x EP x PP dividing the world, with its expert TP = TP)."""
    assert Mesh.of_world(16, 5, tp_size=2, sp_size=2, pp_size=2, ep_size=2) == Mesh(2, 2, 2, 2, 2, rank=5)
    with pytest.raises(UserInputError, match=r"^engine.pipeline_parallel_size=2 x engine.tensor_parallel_size=2 "
                                             r"does not divide the world size 6: the world is data-parallel size x "
                                             r"pipeline-parallel size x tensor-parallel size x sequence-parallel"):
        Mesh.of_world(6, 0, tp_size=2, pp_size=2)
    with pytest.raises(UserInputError, match=r"^engine.expert_parallel_size=4 does not divide the 6 data-parallel x "
                                             r"sequence-parallel ranks of each pipeline stage"):
        Mesh.of_world(12, 0, tp_size=2, sp_size=2, ep_size=4)
    assert Mesh.of_world(12, 0, tp_size=2, sp_size=2, ep_size=3).dp_size == 3


def test_the_coordinates_show_pp_and_ep_only_when_used():
    assert Mesh(2, 2, 1, rank=3).coordinates() == "rank 3: dp 1, tp 1, sp 0"
    assert Mesh(2, 2, 1, 2, 2, rank=5).coordinates() == "rank 5: dp 0, tp 1, sp 0, pp 1, ep 0"
    assert Mesh(2, 2, 1).description() == "DP 2 x TP 2 x SP 1"
    assert Mesh(2, 2, 1, 2, 2).description() == "DP 2 x PP 2 x TP 2 x SP 1 x EP 2"
