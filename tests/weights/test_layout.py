"""Bucket layout: placement, alignment, splits, JSON, and bit-exact pack -> unpack."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix.errors import WeightUpdateError
from rlix.weights.buckets import fusion_order, pack, plan_layout, unpack
from rlix.weights.wire import BucketAssembler, Layout, ReceiveError, bucket_checksum
from rlix.weights.transport import header

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.int8, torch.bool]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs included): only a bitwise comparison can check them."""
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def mixed_state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.randn(300, 64, generator=gen).bfloat16(),  # 38 KB: split at 16 KB
        "norm.weight": torch.randn(64, generator=gen).half(),
        "q.weight": torch.randn(64, 64, generator=gen),
        "position_ids": torch.arange(100, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "mask": torch.rand(33, generator=gen) > 0.5,
        "quant": torch.randint(-128, 127, (17, 3), dtype=torch.int8, generator=gen),
        "lm_head.weight": torch.randn(300, 64, generator=gen).bfloat16(),
    }


def test_many_dtypes_and_shapes_round_trip_exactly():
    sd = mixed_state(torch.Generator().manual_seed(0))
    layout = plan_layout(sd, bucket_bytes=16 << 10, alignment=256)
    out = unpack(layout, pack(layout, sd))
    assert set(out) == set(sd)
    for name, t in sd.items():
        assert torch.equal(out[name], t), name
        assert same_bits(out[name], t), name


def test_placement_is_aligned_and_buckets_bounded():
    sd = mixed_state(torch.Generator().manual_seed(1))
    layout = plan_layout(sd, bucket_bytes=16 << 10, alignment=256)
    assert all(e.offset % 256 == 0 for e in layout.entries)
    assert all(s % 256 == 0 and 0 < s <= 16 << 10 for s in layout.bucket_sizes)
    offsets = layout.bucket_offsets()
    assert offsets == sorted(offsets) and all(o % 256 == 0 for o in offsets)
    # the cache's flat buffer of all buckets gives aligned, dtype-viewable bucket starts
    assert layout.total_bytes == sum(layout.bucket_sizes)


def test_tensor_bigger_than_a_bucket_is_split_and_reassembled():
    gen = torch.Generator().manual_seed(2)
    big = torch.randn(10_000, generator=gen)  # 40 KB over 4 KB buckets
    sd = {"a": torch.randn(10, generator=gen), "big": big, "b": torch.randn(10, generator=gen)}
    layout = plan_layout(sd, bucket_bytes=4096, alignment=256)
    i = layout.index["big"]
    assert layout.is_split(i) and layout.num_parts[i] >= 10
    assert not layout.is_split(layout.index["a"]) and not layout.is_split(layout.index["b"])
    buckets = pack(layout, sd)
    assembler = BucketAssembler(layout)
    got = {}
    for idx, b in enumerate(buckets):
        for name, t in assembler.feed(idx, b):
            got[name] = t
        if idx < len(buckets) - 2:
            assert "big" not in got  # not emitted before its last piece
    assert assembler.pending() == []
    assert same_bits(got["big"], big)


def test_split_tensor_assembles_into_a_given_destination():
    big = torch.randn(5_000)
    layout = plan_layout({"big": big}, bucket_bytes=4096, alignment=256)
    dest = torch.zeros_like(big)
    assembler = BucketAssembler(layout, destination=lambda name: dest)
    out = [item for idx, b in enumerate(pack(layout, {"big": big})) for item in assembler.feed(idx, b)]
    assert out[0][1] is dest and torch.equal(dest, big)


def test_whole_tensors_are_zero_copy_views_and_cached_views_are_reused():
    sd = {"w": torch.randn(32, 32), "b": torch.randn(32)}
    layout = plan_layout(sd, bucket_bytes=1 << 20)
    (bucket,) = pack(layout, sd)
    asm = BucketAssembler(layout)
    first = dict(asm.feed(0, bucket, cache_views=True))
    bucket[: 4].view(torch.float32).fill_(42.0)  # writing the bucket shows through the view
    assert first["w"][0, 0].item() == 42.0
    again = dict(asm.feed(0, bucket, cache_views=True))
    assert again["w"] is first["w"]


def test_layout_json_round_trip_is_compact_and_tamper_evident():
    sd = mixed_state(torch.Generator().manual_seed(3))
    layout = plan_layout(sd, bucket_bytes=16 << 10)
    text = layout.to_json()
    back = Layout.from_json(text)
    assert back.layout_id == layout.layout_id and back.entries == layout.entries
    assert back.bucket_sizes == layout.bucket_sizes and back.to_json() == text
    data = json.loads(text)
    data["tensors"][0][2][0] += 1  # change a shape but keep the id
    with pytest.raises(ReceiveError) as err:
        Layout.from_json(json.dumps(data))
    assert err.value.kind == "layout"
    with pytest.raises(ReceiveError):
        Layout.from_json("{not json")


def test_per_update_metadata_does_not_grow_with_tensor_count():
    many = [(f"model.layers.{i}.mlp.weight", (16, 16), torch.bfloat16) for i in range(10_000)]
    few = [("w", (16 * 10_000, 16), torch.bfloat16)]
    a, b = plan_layout(many, 1 << 20), plan_layout(few, 1 << 20)
    assert a.total_bytes == b.total_bytes and a.num_buckets == b.num_buckets
    assert header(7, 3, a.bucket_sizes[3], 12345) == header(7, 3, b.bucket_sizes[3], 12345)
    # sent once: about the name plus a few numbers per tensor
    assert len(a.to_json()) < 10_000 * (len(many[0][0]) + 30)


def test_check_against_names_every_kind_of_mismatch():
    layout = plan_layout([("a", (2, 3), torch.float32), ("b", (4,), torch.bfloat16)], 4096)
    layout.check_against({"a": ((2, 3), torch.float32), "b": ((4,), torch.bfloat16)})
    cases = [
        ({"a": ((3, 2), torch.float32), "b": ((4,), torch.bfloat16)}, "shape"),
        ({"a": ((2, 3), torch.float16), "b": ((4,), torch.bfloat16)}, "dtype"),
        ({"b": ((4,), torch.bfloat16)}, "not a tensor of the receiving model"),
        ({"a": ((2, 3), torch.float32), "b": ((4,), torch.bfloat16), "c": ((1,), torch.float32)},
         "does not send"),
    ]
    for specs, words in cases:
        with pytest.raises(ReceiveError, match=words):
            layout.check_against(specs)


def test_pack_refuses_tensors_that_do_not_match_the_layout():
    layout = plan_layout({"a": torch.zeros(4)}, 4096)
    with pytest.raises(WeightUpdateError, match="does not match"):
        pack(layout, {"a": torch.zeros(5)})
    with pytest.raises(WeightUpdateError, match="missing"):
        pack(layout, {"b": torch.zeros(4)})


def test_checksum_detects_a_flipped_bit_and_a_swap():
    gen = torch.Generator().manual_seed(4)
    bucket = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen)
    base = bucket_checksum(bucket)
    assert bucket_checksum(bucket.clone()) == base
    flipped = bucket.clone()
    flipped[777_777] ^= 4
    assert bucket_checksum(flipped) != base
    swapped = bucket.clone()
    swapped[:4], swapped[1024:1028] = bucket[1024:1028].clone(), bucket[:4].clone()
    assert torch.equal(swapped, bucket) or bucket_checksum(swapped) != base


shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=12),
       bucket_kib=st.integers(1, 8), alignment=st.sampled_from([8, 64, 256]), seed=st.integers(0, 2**31))
def test_property_pack_unpack_is_bit_identical(specs, bucket_kib, alignment, seed):
    gen = torch.Generator().manual_seed(seed)
    sd = {f"t{i}": random_bits(shape, dtype, gen) for i, (shape, dtype) in enumerate(specs)}
    layout = plan_layout(sd, bucket_bytes=bucket_kib * 1024, alignment=alignment)
    back = Layout.from_json(layout.to_json())
    out = unpack(back, pack(layout, sd))
    assert set(out) == set(sd)
    for name, t in sd.items():
        assert same_bits(out[name], t), name


def test_fusion_order_puts_fused_projections_end_to_end_and_keeps_everything_else():
    names = ["model.embed_tokens.weight"]
    for layer in range(2):
        p = f"model.layers.{layer}"
        for m in ("q_proj", "k_proj", "v_proj"):
            names += [f"{p}.self_attn.{m}.weight", f"{p}.self_attn.{m}.bias"]
        names += [f"{p}.self_attn.o_proj.weight", f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight",
                  f"{p}.mlp.down_proj.weight", f"{p}.input_layernorm.weight"]
    names += ["other.q_proj.weight", "other.k_proj.weight", "lm_head.weight"]  # no v_proj: left alone
    tensors = {n: torch.full((16, 8), float(i)) for i, n in enumerate(names)}
    ordered = fusion_order(tensors)
    assert sorted(ordered) == sorted(names)
    assert all(ordered[n] is tensors[n] for n in names)
    got = list(ordered)
    p = "model.layers.1.self_attn"
    at = got.index(f"{p}.q_proj.weight")
    assert got[at: at + 6] == [f"{p}.{m}_proj.{a}" for a in ("weight", "bias") for m in "qkv"]
    at = got.index("model.layers.1.mlp.gate_proj.weight")
    assert got[at + 1] == "model.layers.1.mlp.up_proj.weight"
    assert got.index("other.q_proj.weight") + 1 == got.index("other.k_proj.weight")
    assert got[0] == "model.embed_tokens.weight" and got[-1] == "lm_head.weight"
    assert list(fusion_order(ordered)) == got  # already in order: unchanged
    # planned from this order, each fused group is one contiguous run of bytes
    layout = plan_layout(ordered, bucket_bytes=4096, alignment=256)
    starts = {e.name: layout.bucket_offsets()[e.bucket] + e.offset for e in layout.entries}
    q, k, v = (starts[f"{p}.{m}_proj.weight"] for m in "qkv")
    assert k - q == v - k == 16 * 8 * 4
