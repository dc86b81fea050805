"""The committed gRPC stubs must match what proto/*.proto generates."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_generator():
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_protos(tmp_path):
    generated = _load_generator().generate(tmp_path)
    assert generated, "no stubs generated"
    committed_dir = ROOT / "common" / "grpc_gen"
    for path in generated:
        committed = committed_dir / path.name
        assert committed.exists(), f"{path.name} is generated but not committed: run `make proto`"
        assert committed.read_text() == path.read_text(), f"{path.name} drifted from proto/: run `make proto`"
    stale = {p.name for p in committed_dir.glob("*_pb2*.py*")} - {p.name for p in generated}
    assert not stale, f"stubs without a .proto: {sorted(stale)}"
