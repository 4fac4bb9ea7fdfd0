"""The weights' fingerprint (forja/train/resilience/fingerprint.py): one flipped bit or two swapped
tensors change it, equal weights give equal ones, and the odd replicas out are named."""

from __future__ import annotations

import torch
from torch import nn

from forja.train.resilience.drills import parse_drill
from forja.train.resilience.fingerprint import flip_one_bit, odd_ones, weights_fingerprint


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))


def test_equal_weights_agree_and_one_flipped_bit_does_not():
    a, b = _model(), _model()
    assert weights_fingerprint([a]) == weights_fingerprint([b])
    before = a[0].weight.detach().clone()
    said = flip_one_bit([a])
    assert "bit 10 of the first element" in said
    changed = (a[0].weight.detach() != before).nonzero().tolist()
    assert changed == [[0, 0]]  # one element of one weight, by about 1e-4 of itself
    assert abs(a[0].weight[0, 0].item() / before[0, 0].item() - 1) < 1e-3
    assert weights_fingerprint([a]) != weights_fingerprint([b])


def test_swapped_tensors_of_the_same_shape_change_it():
    a, b = _model(), _model()
    with torch.no_grad():
        b[0].weight.copy_(a[1].weight)
        b[1].weight.copy_(a[0].weight)
    assert weights_fingerprint([a]) != weights_fingerprint([b])


def test_the_odd_ones_out_are_named_and_a_tie_names_every_replica():
    assert odd_ones([7, 7, 7]) == []
    assert odd_ones([7, 9, 7, 7]) == [1]
    assert odd_ones([7, 9]) == [0, 1]  # two replicas: which one is right cannot be told
    assert odd_ones([1, 2, 1, 2]) == [0, 1, 2, 3]


def test_the_bitflip_drill_defaults_to_rank_0_and_takes_a_group():
    assert parse_drill("bitflip@5").rank == 0
    drill = parse_drill("bitflip@5:group=1")
    assert (drill.kind, drill.step, drill.group) == ("bitflip", 5, 1)
