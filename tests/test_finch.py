"""FINCH: first neighbours and components by hand, known clusters recovered, the hierarchy
nests, and the cluster-mean cap."""

import torch

from protofl.algorithms.finch import cluster_means, components, finch, first_neighbours


def _same_grouping(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.unsqueeze(0) == a.unsqueeze(1), b.unsqueeze(0) == b.unsqueeze(1))


def test_first_neighbours_and_components_by_hand():
    x = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.1, 1.0], [0.2, 1.0]])
    # cosine: 0 <-> 1 are mutual; 3's nearest is 4 (angle), 2's nearest is 3, 4's nearest is 3
    assert first_neighbours(x, "cosine").tolist() == [1, 0, 3, 4, 3]
    assert components(torch.tensor([1, 0, 3, 2, 2])).tolist() == [0, 0, 1, 1, 1]
    assert components(torch.tensor([1, 2, 0, 4, 3])).tolist() == [0, 0, 0, 1, 1]


def _three_groups():
    g = torch.Generator().manual_seed(0)
    dirs = torch.eye(3) * 5.0
    groups = torch.tensor([0, 1, 2]).repeat_interleave(6)
    x = dirs[groups] + 0.3 * torch.rand(18, 3, generator=g)
    perm = torch.randperm(18, generator=g)
    return x[perm], groups[perm]


def _angles(degrees):
    r = torch.tensor(degrees, dtype=torch.float64) * torch.pi / 180
    return torch.stack([r.cos(), r.sin()], 1) * torch.linspace(1, 2, len(degrees)).unsqueeze(1)


def test_recovers_known_clusters_by_hand():
    # three groups of two tight pairs (cosine depends on the angle only): pairs 1 degree wide,
    # pairs of a group 5 degrees apart, groups 40 degrees apart. Step 1 links each point to
    # its pair partner (6 clusters), step 2 each pair to the other pair of its group
    # (3 clusters), step 3 would give one cluster and is not kept.
    deg = [0, 1, 5, 6, 40, 41, 45, 46, 80, 81, 85, 86]
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    x = _angles(deg)[perm]
    pairs = torch.arange(6).repeat_interleave(2)[perm]
    groups = torch.arange(3).repeat_interleave(4)[perm]
    parts = finch(x, "cosine")
    assert len(parts) == 2
    assert _same_grouping(parts[0], pairs) and _same_grouping(parts[1], groups)


def test_hierarchy_nests():
    x, _ = _three_groups()
    parts = finch(x, "cosine")
    sizes = [int(p.max()) + 1 for p in parts]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    for fine, coarse in zip(parts, parts[1:]):
        for c in range(int(fine.max()) + 1):  # every finer cluster lies inside one coarser
            assert len(torch.unique(coarse[fine == c])) == 1


def test_euclidean_known_clusters():
    x = torch.tensor([[0.0, 0.0], [0.1, 0.0], [0.0, 0.1], [5.0, 5.0], [5.1, 5.0], [5.0, 5.2]])
    assert _same_grouping(finch(x, "euclidean")[-1], torch.tensor([0, 0, 0, 1, 1, 1]))


def test_tiny_inputs():
    assert [p.tolist() for p in finch(torch.ones(1, 3))] == [[0]]
    assert [p.tolist() for p in finch(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))] == [[0, 0]]


def test_cluster_means_largest_first_and_capped():
    x = torch.tensor([[0.0], [2.0], [10.0], [11.0], [12.0], [100.0]])
    labels = torch.tensor([0, 0, 1, 1, 1, 2])
    means, sizes = cluster_means(x, labels, 2)
    assert means.tolist() == [[11.0], [1.0]] and sizes.tolist() == [3.0, 2.0]
