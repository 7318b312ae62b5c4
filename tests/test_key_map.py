"""The prefix cache's key -> block map against a plain dict: keys small (the array), negative,
past the array's reach and past int64 (the dict), in lists and int64 arrays, mixed in one call;
the allocator's calls (which also keep its block -> key arrays) compiled and in numpy alike."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.core.key_map import DENSE_KEYS, BlockKeyMap

KEYS = st.sampled_from([0, 1, 2, 3, 5, 900, 5000, DENSE_KEYS - 1, DENSE_KEYS, -1, -(1 << 30), 1 << 40, 1 << 70])


def _cut(keys: list[int], model: dict[int, int], limit: int) -> list[int]:
    out = []
    for k in keys[: max(limit, 0)]:
        if k not in model:
            break
        out.append(model[k])
    return out


@pytest.mark.parametrize("compiled", [True, False])
@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "add",
                    "add_array",
                    "remove",
                    "remove_array",
                    "forget",
                    "pop",
                    "set",
                    "leading",
                    "leading_array",
                    "register",
                    "forget_blocks",
                ]
            ),
            st.lists(KEYS, min_size=1, max_size=6),
            st.integers(-1, 7),
        ),
        max_size=30,
    )
)
def test_the_map_answers_as_a_dict_would(compiled, ops):
    m, model, next_block = BlockKeyMap(compiled=compiled), {}, 0
    # The allocator's record of the blocks registered through ``register_blocks``: their keys
    # leave only through ``forget_blocks``, as in the allocator.
    keyed, key_of = np.zeros(1000, dtype=bool), np.zeros(1000, dtype=np.int64)
    via_blocks: set[int] = set()
    for op, keys, limit in ops:
        fits = all(-(1 << 63) <= k < (1 << 63) for k in keys)
        as_array = op.endswith("_array") and fits
        arg = np.asarray(keys, dtype=np.int64) if as_array else keys
        if op.startswith("add"):
            blocks = list(range(next_block, next_block + len(keys)))
            next_block += len(keys)
            ok = m.add_absent(arg, blocks)
            can = len(set(keys)) == len(keys) and not set(keys) & set(model)
            if ok:
                assert can
                model.update(zip(keys, blocks, strict=True))
            else:  # refusing is allowed (the caller goes one by one), changing anything is not
                assert not can or not fits or len({0 <= k < DENSE_KEYS for k in keys}) == 2
        elif op.startswith("remove"):
            present = [k for k in dict.fromkeys(keys) if k in model and k not in via_blocks]
            if present and (op == "remove" or all(-(1 << 63) <= k < (1 << 63) for k in present)):
                m.remove(np.asarray(present, dtype=np.int64) if op.endswith("_array") else present)
                for k in present:
                    del model[k]
        elif op == "forget":  # keys known to be registered, as the allocator's own record gives them
            present = [k for k in dict.fromkeys(keys) if k in model and k not in via_blocks and k < (1 << 63)]
            m.forget(np.asarray(present, dtype=np.int64))
            for k in present:
                del model[k]
        elif op == "register":
            blocks = np.arange(next_block, next_block + len(keys), dtype=np.int64)
            next_block += len(keys)
            arg = np.asarray(keys, dtype=np.int64) if fits else keys
            ok = m.register_blocks(arg, blocks, keyed, key_of)
            can = len(set(keys)) == len(keys) and not set(keys) & set(model)
            if ok:
                assert can and fits
                model.update(zip(keys, blocks.tolist(), strict=True))
                via_blocks.update(keys)
                assert keyed[blocks].all() and key_of[blocks].tolist() == keys
            else:  # as ``add_absent``: a refusal changes nothing
                assert not can or not fits or len({0 <= k < DENSE_KEYS for k in keys}) == 2
                assert not keyed[blocks].any()
        elif op == "forget_blocks":  # some blocks with keys, some without
            blocks = np.flatnonzero(keyed)[::2]
            blocks = np.concatenate([blocks, np.flatnonzero(~keyed)[:3]])
            gone = key_of[blocks[keyed[blocks]]].tolist()
            m.forget_blocks(blocks, keyed, key_of)
            assert not keyed[blocks].any()
            for k in gone:
                del model[k]
                via_blocks.discard(k)
        elif op == "pop":
            if keys[0] in via_blocks:
                continue
            if keys[0] in model:
                assert m.pop(keys[0]) == model.pop(keys[0])
            else:
                with pytest.raises(KeyError):
                    m.pop(keys[0])
        elif op == "set":
            if keys[0] not in model:
                m[keys[0]] = next_block
                model[keys[0]] = next_block
                next_block += 1
        else:
            assert m.leading(arg, limit) == _cut(keys, model, limit)
        assert len(m) == len(model)
        assert m.as_dict() == model
        assert all((k in m) == (k in model) for k in keys)
        assert all(m.get(k) == model.get(k) for k in keys)


def test_a_prompt_of_array_keys_in_one_call():
    m = BlockKeyMap()
    keys = np.arange(100, 400, dtype=np.int64)
    assert m.add_absent(keys, list(range(300)))
    assert not m.add_absent(keys[5:6], [999])  # registered already: nothing changes
    assert not m.add_absent(np.asarray([7, 7]), [1, 2])  # listed twice: nothing changes
    assert len(m) == 300 and m.get(7) is None
    assert m.leading(keys, 50) == list(range(50))
    m.remove(keys[200:])
    assert m.leading(keys, 300) == list(range(200))
    with pytest.raises(KeyError):
        m.remove(keys[250:260])
    assert m.leading(np.asarray([10**6, 100]), 2) == []  # past the array: not registered
