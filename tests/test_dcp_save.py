"""backend.runtime.dcp_save on two gloo ranks: each replicated box written once; a save of the same
state as the last one agrees on its writers without gathering the ranks' lists, a save of another
state chooses again; a rank that cannot write makes every rank fail, naming its file."""

import multiprocessing as mp

import pytest

torch = pytest.importorskip("torch")

from backend.models.placement import Box  # noqa: E402
from backend.runtime import dcp, dcp_save  # noqa: E402


def _halves(t: torch.Tensor) -> dcp.Boxes:
    """A replicated [4, 6] tensor as two boxes, its top and bottom rows."""
    boxes = [Box((0, 0), (2, 6), 0, (2, 6), (6, 1)), Box((2, 0), (2, 6), 12, (2, 6), (6, 1))]
    return dcp.Boxes([t], (4, 6), boxes)


def _states(rank: int) -> list[dict]:
    w = torch.arange(24.0).reshape(4, 6)
    v = torch.arange(10.0)
    same = {"w": _halves(w), "train": {"step": 1}, f"rng/{rank}": rank}
    other = {"w": _halves(w + 1), "v": v, "train": {"step": 2}, f"rng/{rank}": rank}
    return [same, same, other]


def _save_on_rank(rank: int, store: str, folders: list, out, limit: int | None) -> None:
    import resource
    import signal

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    gathers = []
    gather = dcp_save.gather_objects
    dcp_save.gather_objects = lambda obj: gathers.append(1) or gather(obj)
    try:
        for folder, state in zip(folders, _states(rank)):
            if limit is not None and rank == 1:  # writes past `limit` bytes fail, as on a full disk
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
            if rank == 0:  # the save's first exchange keeps rank 1 from writing before this
                folder.mkdir()
            files = dcp_save.write(state, folder, rank)
            out.put((rank, folder.name, len(gathers), sorted(files)))
    except BaseException as e:  # noqa: BLE001 - the test looks at what each rank raised
        out.put((rank, "error", type(e).__name__, getattr(e, "filename", None) or str(e)))
    dist.destroy_process_group()


def _run(tmp_path, names: list[str], limit: int | None = None) -> list:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    folders = [tmp_path / n for n in names]
    procs = [ctx.Process(target=_save_on_rank, args=(r, str(tmp_path / "store"), folders, out, limit))
             for r in range(2)]
    for p in procs:
        p.start()
    got = []
    while any(p.is_alive() for p in procs) or not out.empty():
        try:
            got.append(out.get(timeout=1))
        except Exception:  # noqa: BLE001 - nothing yet: look again while a rank is alive
            pass
    for p in procs:
        p.join(timeout=60)
    return got


def test_the_same_state_saves_without_gathering_and_another_chooses_again(tmp_path):
    got = _run(tmp_path, ["a", "b", "c"])
    gathers = {(r, name): n for r, name, n, _ in got}
    assert gathers == {(0, "a"): 1, (1, "a"): 1, (0, "b"): 1, (1, "b"): 1, (0, "c"): 2, (1, "c"): 2}, got
    files = {name: f for r, name, _, f in got if r == 0}
    assert files["a"] == [".metadata", "__0_0.distcp", "__1_0.distcp"], files
    for name, shift in (("a", 0), ("b", 0), ("c", 1)):
        full = dcp.read_full(tmp_path / name)
        assert torch.equal(full["w"], torch.arange(24.0).reshape(4, 6) + shift)
        chunks = dcp._reader(tmp_path / name).read_metadata().state_dict_metadata["w"].chunks
        assert len(chunks) == 2  # each box once: one from each rank
        objects = dcp.read_objects(tmp_path / name, ["train", "rng/0", "rng/1"])
        assert objects == {"train": {"step": 1 + shift}, "rng/0": 0, "rng/1": 1}
    assert torch.equal(dcp.read_full(tmp_path / "c")["v"], torch.arange(10.0))
    assert not list(tmp_path.rglob(f"*{dcp_save.REPORT}"))  # rank 0 removed them


def test_a_rank_that_cannot_write_makes_every_rank_fail_naming_its_file(tmp_path):
    got = _run(tmp_path, ["a"], limit=64)
    errors = {r: rest for r, kind, *rest in got if kind == "error"}
    path = str(tmp_path / "a" / "__1_0.distcp")
    assert errors == {0: ["OSError", path], 1: ["OSError", path]}, got
