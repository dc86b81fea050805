"""Chained block hashes: deterministic, prefix-sensitive, salted, full blocks only."""
import hashlib
import os
import subprocess
import sys

import msgspec

from scheduler.prefix_hash import ROOT_BLOCK_HASH, extend_block_hashes, hash_block_tokens

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_hash_is_sha256_of_the_msgpack_encoded_chain_link():
    expected = hashlib.sha256(msgspec.msgpack.encode((ROOT_BLOCK_HASH, [1, 2, 3, 4], ["salt"]))).digest()
    assert hash_block_tokens(ROOT_BLOCK_HASH, (1, 2, 3, 4), ("salt",)) == expected
    assert len(expected) == 32


def test_only_full_blocks_are_hashed_and_hashing_is_incremental():
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(7)), block_size=4)
    assert len(hashes) == 1
    extend_block_hashes(hashes, list(range(8)), block_size=4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(ROOT_BLOCK_HASH, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    at_once: list[bytes] = []
    extend_block_hashes(at_once, list(range(8)), block_size=4)
    assert at_once == hashes


def test_equal_blocks_after_different_prefixes_hash_differently():
    a: list[bytes] = []
    b: list[bytes] = []
    extend_block_hashes(a, [1, 2, 3, 4, 9, 9, 9, 9], 4)
    extend_block_hashes(b, [1, 2, 3, 5, 9, 9, 9, 9], 4)
    assert a[0] != b[0] and a[1] != b[1]


def test_cache_salt_separates_namespaces_through_the_whole_chain():
    tokens = list(range(12))
    plain, empty, salted, other = [], [], [], []
    extend_block_hashes(plain, tokens, 4)
    extend_block_hashes(empty, tokens, 4, cache_salt="")
    extend_block_hashes(salted, tokens, 4, cache_salt="alice")
    extend_block_hashes(other, tokens, 4, cache_salt="bob")
    assert plain == empty  # an empty salt is no salt
    for i in range(3):
        assert len({plain[i], salted[i], other[i]}) == 3


def test_hashes_are_identical_across_processes_and_hash_seeds():
    code = ("from scheduler.prefix_hash import extend_block_hashes as e; h = []; "
            "e(h, list(range(40)), 16, cache_salt='s'); print(h[-1].hex())")
    here: list[bytes] = []
    extend_block_hashes(here, list(range(40)), 16, cache_salt="s")
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert out.stdout.strip() == here[-1].hex()
