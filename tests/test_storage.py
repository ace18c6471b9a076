"""The storage layer (fzero.storage's files, pool and scratch directories) on real files and real threads."""

import errno
import gc
import json
import mmap
import os
import pathlib
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from fzero.storage import (
    ALIGN,
    IOPool,
    Region,
    ScratchDir,
    StorageError,
    StorageFullError,
    StoragePathError,
    SwapCorruptError,
    SwapFile,
    aligned_empty,
    round_up,
)
from fzero.storage.aligned import tensor_bytes
from fzero.storage.errors import storage_error

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
FZERO = pathlib.Path(__file__).resolve().parents[1] / "fzero"


def _io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fzero-io")]


def _accepts_o_direct(directory: pathlib.Path) -> bool:
    """Whether a raw O_DIRECT open and an aligned 4096-byte write and read work in `directory`."""
    probe = directory / "o_direct_probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return False
    try:
        page = mmap.mmap(-1, ALIGN)  # page-aligned
        return os.pwrite(fd, page, 0) == ALIGN and os.preadv(fd, [page], 0) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def _random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """An aligned buffer whose first nbytes are random (NaN and inf patterns included) and the rest zero."""
    buf = aligned_empty(nbytes)
    buf.zero_()
    g = torch.Generator().manual_seed(seed)
    buf[:nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return buf


def _roundtrip(path: pathlib.Path, regions: list[Region], *, direct, threads=2, block_size=8192, seed=0) -> bool:
    """Writes random bytes into every region through an IOPool, reads them back with checksums verified, checks
    them bitwise; returns whether O_DIRECT was used."""
    with SwapFile(path, regions, direct=direct) as f, IOPool(threads, block_size) as pool:
        assert f.size == os.path.getsize(path)
        data = {r.name: _random_bytes(r.nbytes, seed + i) for i, r in enumerate(regions)}
        writes = {r.name: pool.write(f, f.offset(r.name), data[r.name], r.nbytes) for r in regions}
        crcs = {name: w.result() for name, w in writes.items()}
        for r in regions:
            assert len(crcs[r.name]) == -(-r.nbytes // block_size)
            back = aligned_empty(r.nbytes)
            pool.read(f, f.offset(r.name), back, r.nbytes, crcs[r.name]).result()
            assert torch.equal(back[: r.nbytes], data[r.name][: r.nbytes]), r
        f.check_size()
        return f.direct


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    layout=st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 20000)), min_size=1, max_size=4),
    threads=st.integers(1, 4),
    block_size=st.sampled_from([4096, 8192]),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_property(tmp_path, layout, threads, block_size, seed):
    regions = [Region(f"r{i}", dtype, numel) for i, (dtype, numel) in enumerate(layout)]
    path = tmp_path / f"swap-{seed}-{threads}-{block_size}"
    _roundtrip(path, regions, direct=False, threads=threads, block_size=block_size, seed=seed)
    path.unlink()


REGIONS = [Region("a", torch.float32, 3000), Region("b", torch.bfloat16, 0), Region("c", torch.int64, 5000)]


def test_direct_on_the_test_filesystem(tmp_path):
    supported = _accepts_o_direct(tmp_path)
    assert _roundtrip(tmp_path / "auto", REGIONS, direct=None) is supported
    assert _roundtrip(tmp_path / "buffered", REGIONS, direct=False) is False
    if supported:
        assert _roundtrip(tmp_path / "direct", REGIONS, direct=True) is True
    else:
        with pytest.raises(StorageError, match="does not support O_DIRECT") as info:
            SwapFile(tmp_path / "direct", REGIONS, direct=True)
        assert str(tmp_path / "direct") in str(info.value)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
def test_direct_on_tmpfs():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        supported = _accepts_o_direct(pathlib.Path(d))
        assert _roundtrip(pathlib.Path(d) / "auto", REGIONS, direct=None) is supported
        if supported:
            assert _roundtrip(pathlib.Path(d) / "direct", REGIONS, direct=True) is True
        else:
            with pytest.raises(StorageError, match="does not support O_DIRECT"):
                SwapFile(pathlib.Path(d) / "direct", REGIONS, direct=True)


@pytest.mark.parametrize("direct", [False, None])
def test_a_standard_safetensors_reader_reads_every_region(tmp_path, direct):
    path = tmp_path / "swap.safetensors"
    regions = [*REGIONS, Region("d", torch.float16, 4096 * 3), Region("e", torch.float32, 1)]
    written = {}
    with SwapFile(path, regions, direct=direct) as f, IOPool(2, 4096) as pool:
        for r in regions:
            x = torch.randn(r.numel).to(r.dtype) if r.dtype.is_floating_point else torch.arange(r.numel) * 7
            buf = aligned_empty(r.nbytes)
            buf[: r.nbytes].view(r.dtype).copy_(x)
            pool.write(f, f.offset(r.name), buf, r.nbytes).result()
            written[r.name] = x
        offsets = {r.name: f.offset(r.name) for r in regions}
        size = f.size

    with safe_open(str(path), framework="pt") as st_file:
        pads = {f"__pad{i}__" for i, r in enumerate(regions) if r.capacity > r.nbytes}
        assert set(st_file.keys()) == set(written) | pads
        assert st_file.metadata() == {"format": "fzero-swap", "version": "1"}
        for name, x in written.items():
            y = st_file.get_tensor(name)
            assert y.dtype == x.dtype and y.shape == x.shape
            assert torch.equal(y.view(torch.uint8), x.view(torch.uint8)), name

    raw = path.read_bytes()
    assert len(raw) == size
    (n,) = struct.unpack("<Q", raw[:8])
    start = 8 + n
    assert start % ALIGN == 0
    header = json.loads(raw[8:start])
    for name, offset in offsets.items():
        assert offset % ALIGN == 0
        assert start + header[name]["data_offsets"][0] == offset


def test_flipped_byte_fails_the_checksum(tmp_path):
    path = tmp_path / "swap"
    r = Region("m", torch.float32, 5000)  # 20000 bytes: blocks at 0, 4096, 8192, ...
    with SwapFile(path, [r], direct=False) as f, IOPool(2, 4096) as pool:
        buf = _random_bytes(r.nbytes, 1)
        crcs = pool.write(f, f.offset("m"), buf, r.nbytes).result()
        with open(path, "r+b") as g:
            g.seek(f.offset("m") + 5000)
            byte = g.read(1)
            g.seek(f.offset("m") + 5000)
            g.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(SwapCorruptError) as info:
            pool.read(f, f.offset("m"), aligned_empty(r.nbytes), r.nbytes, crcs).result()
        message = str(info.value)
        assert str(path) in message and f"byte offset {f.offset('m') + 4096}" in message
        assert f"{crcs[1]:#010x}" in message
        pool.read(f, f.offset("m"), aligned_empty(r.nbytes), r.nbytes).result()  # unverified: no error


@pytest.mark.parametrize("direct", [False, None])
def test_truncated_file(tmp_path, direct):
    path = tmp_path / "swap"
    regions = [Region("a", torch.float32, 4096), Region("b", torch.float32, 4096)]
    with SwapFile(path, regions, direct=direct) as f, IOPool(2, 4096) as pool:
        crcs = pool.write(f, f.offset("b"), _random_bytes(16384, 2), 16384).result()
        f.check_size()
        cut = f.offset("b") + 5000  # inside region b, not on a block boundary
        os.truncate(path, cut)
        with pytest.raises(SwapCorruptError, match="truncated") as info:
            pool.read(f, f.offset("b"), aligned_empty(16384), 16384, crcs).result()
        assert str(path) in str(info.value) and "got" in str(info.value)
        with pytest.raises(SwapCorruptError, match=f"truncated to {cut} bytes, expected {f.size}"):
            f.check_size()
        # directly: the bytes expected and got
        buf = aligned_empty(16384)  # held: the memoryview alone does not keep it alive while pread writes into it
        with pytest.raises(SwapCorruptError, match=f"reading 16384 bytes at byte offset {f.offset('b')} got 5000"):
            f.pread(f.offset("b"), tensor_bytes(buf))


def test_disk_full_at_creation(tmp_path):
    """RLIMIT_FSIZE stands in for a full disk: the 4 MiB file cannot be preallocated, so creation fails
    (EFBIG), and a file that fits is created and written normally."""
    code = textwrap.dedent(f"""
        import resource, signal, sys, types
        # only the storage layer, which imports nothing else of fzero: no need for the package's __init__
        pkg = types.ModuleType("fzero"); pkg.__path__ = [{str(FZERO)!r}]; sys.modules["fzero"] = pkg
        import torch
        from fzero.storage import IOPool, Region, StorageFullError, SwapFile, aligned_empty
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        with SwapFile({str(tmp_path / "small")!r}, [Region("x", torch.uint8, 512 << 10)]) as f, IOPool() as pool:
            pool.write(f, f.offset("x"), aligned_empty(512 << 10), 512 << 10).result()
        try:
            SwapFile({str(tmp_path / "big")!r}, [Region("x", torch.uint8, 4 << 20)])
        except StorageFullError as e:
            print(type(e).__name__, type(e.__cause__).__name__, e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("StorageFullError OSError "), out.stdout
    assert str(tmp_path / "big") in out.stdout and "EFBIG" in out.stdout, out.stdout
    assert not (tmp_path / "big").exists()  # a failed file does not keep what space it got
    assert (tmp_path / "small").stat().st_size == 4096 + (512 << 10)


def test_error_mapping():
    e = storage_error(OSError(errno.ENOSPC, "No space left on device"), "/x/f", "write", offset=8192, nbytes=4096)
    assert isinstance(e, StorageFullError) and str(e) == (
        "/x/f: no space to write 4096 bytes at byte offset 8192: ENOSPC (No space left on device)"
    )
    assert type(storage_error(OSError(errno.EDQUOT, "quota"), "/x/f", "write")) is StorageFullError
    e = storage_error(OSError(errno.EIO, "Input/output error"), "/x/f", "read", offset=0, nbytes=1)
    assert type(e) is StorageError and "EIO" in str(e) and "/x/f" in str(e)
    assert type(storage_error(OSError(errno.EACCES, "denied"), "/x/f", "create", opening=True)) is StoragePathError
    assert type(storage_error(OSError(errno.EACCES, "denied"), "/x/f", "write")) is StorageError


def test_bad_directories(tmp_path):
    with pytest.raises(StoragePathError, match=str(tmp_path / "missing")):
        SwapFile(tmp_path / "missing" / "swap", REGIONS)
    (tmp_path / "plain").write_text("")
    with pytest.raises(StoragePathError, match=str(tmp_path / "plain")):
        SwapFile(tmp_path / "plain" / "swap", REGIONS)
    with pytest.raises(StoragePathError, match=f"{tmp_path / 'missing'}: the offload directory does not exist"):
        ScratchDir(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()  # the offload path is never created for the user
    with pytest.raises(StoragePathError, match=f"{tmp_path / 'plain'}: the offload path is not a directory"):
        ScratchDir(tmp_path / "plain")


def test_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        try:  # root (as in containers) writes through the mode bits: ask the filesystem, not the mode
            (ro / "probe").touch()
        except PermissionError:
            pass
        else:
            pytest.skip("running as root: a 0o500 directory is still writable")
        with pytest.raises(StoragePathError, match=str(ro)):
            ScratchDir(ro)
        with pytest.raises(StoragePathError, match=str(ro / "swap")):
            SwapFile(ro / "swap", REGIONS)
    finally:
        ro.chmod(0o700)


def test_io_errors_reach_the_future_and_threads_end(tmp_path):
    path = tmp_path / "swap"
    pool = IOPool(3, 4096)
    with SwapFile(path, [Region("x", torch.uint8, 64 << 10)], direct=False) as f:
        pool.write(f, f.offset("x"), aligned_empty(64 << 10), 64 << 10).result()
        assert 1 <= len(_io_threads()) <= 3  # started on demand
        os.truncate(path, 4096)
        future = pool.read(f, f.offset("x"), aligned_empty(64 << 10), 64 << 10)
        with pytest.raises(SwapCorruptError, match=str(path)):
            future.result()
        assert not future.cancel()
    pool.close()
    pool.close()
    assert _io_threads() == []
    with pytest.raises(RuntimeError, match="after close"):
        pool.write(f, 0, aligned_empty(4096), 4096)
    with IOPool(2) as pool2:
        with SwapFile(path, REGIONS) as f:
            pool2.write(f, f.offset("a"), aligned_empty(12000), 12000).result()
    assert _io_threads() == []


def test_a_forgotten_pool_leaves_no_thread(tmp_path):
    pool = IOPool(2, 4096)
    with SwapFile(tmp_path / "swap", REGIONS, direct=False) as f:
        pool.write(f, f.offset("c"), aligned_empty(40000), 40000).result()
    threads = _io_threads()
    assert threads
    del pool
    gc.collect()
    assert not any(t.is_alive() for t in threads) and _io_threads() == []


def test_programming_errors(tmp_path):
    for bad in (0, -1):
        with pytest.raises(ValueError, match="threads"):
            IOPool(threads=bad)
    for bad in (0, 1000, 4096 + 512):
        with pytest.raises(ValueError, match="block_size"):
            IOPool(block_size=bad)
    with pytest.raises(ValueError, match="appears twice"):
        SwapFile(tmp_path / "s", [Region("a", torch.float32, 1), Region("a", torch.float32, 1)])
    with pytest.raises(ValueError, match="reserved"):
        SwapFile(tmp_path / "s", [Region("__pad0__", torch.float32, 1)])
    with SwapFile(tmp_path / "swap", REGIONS, direct=False) as f, IOPool(1, 4096) as pool:
        with pytest.raises(ValueError, match=r"no region 'z'; the file has \['a', 'b', 'c'\]"):
            f.offset("z")
        with pytest.raises(ValueError, match="outside the file"):
            f.pwrite(f.size - 10, memoryview(bytes(11)))
        with pytest.raises(ValueError, match="buf has 100 bytes"):
            pool.write(f, f.offset("a"), torch.empty(100, dtype=torch.uint8), 101)
        crcs = pool.write(f, f.offset("a"), aligned_empty(12000), 12000).result()
        with pytest.raises(ValueError, match="2 checksums for 12000 bytes .* expected 3"):
            pool.read(f, f.offset("a"), aligned_empty(12000), 12000, crcs[:2])
    with pytest.raises(ValueError, match="closed"):
        f.pread(0, memoryview(bytearray(4096)))


def test_misaligned_direct_transfers(tmp_path):
    if not _accepts_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    with SwapFile(tmp_path / "swap", REGIONS, direct=True) as f, IOPool(2, 4096) as pool:
        buf = aligned_empty(3 * ALIGN)
        view = tensor_bytes(buf)
        for offset, part in [
            (f.offset("a") + 512, view[:ALIGN]),
            (f.offset("a"), view[:100]),
            (0, view[1 : ALIGN + 1]),
        ]:
            with pytest.raises(ValueError, match="O_DIRECT write needs offset, length and buffer address"):
                f.pwrite(offset, part)
            with pytest.raises(ValueError, match="O_DIRECT read needs"):
                f.pread(offset, part)
        with pytest.raises(ValueError, match="O_DIRECT needs offset and buffer address"):
            pool.write(f, f.offset("a"), buf[1:], 100)
        with pytest.raises(ValueError, match="O_DIRECT needs offset and buffer address"):
            pool.read(f, f.offset("a") + 512, buf, 100)
        with pytest.raises(ValueError, match="needs 12288 .*use aligned_empty"):
            pool.write(f, f.offset("a"), buf[:12000], 12000)  # round_up(12000) bytes are written


def test_aligned_buffers():
    assert [round_up(n) for n in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]
    assert round_up(5, 4) == 8
    for n in (0, 1, 4096, 12345):
        t = aligned_empty(n)
        assert t.dtype == torch.uint8 and t.numel() == round_up(n)
        assert n == 0 or t.data_ptr() % ALIGN == 0


def test_scratch_dir(tmp_path):
    with ScratchDir(tmp_path) as scratch:
        assert scratch.path.parent == tmp_path and scratch.path.is_dir()
        assert scratch.path.name.startswith("fzero-") and f"-{os.getpid()}-" in scratch.path.name
        with pytest.raises(ValueError, match="plain file name"):
            scratch.file("a/b")
        with SwapFile(scratch.file("swap"), REGIONS) as f:
            assert f.path.parent == scratch.path
    assert not scratch.path.exists()
    scratch.close()  # idempotent
    assert list(tmp_path.iterdir()) == []


def test_scratch_dir_removes_only_dead_runs_of_this_host(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    first = ScratchDir(tmp_path)
    prefix = first.path.name.rsplit("-", 2)[0]  # fzero-<this host>
    first.close()
    dead = tmp_path / f"{prefix}-{child.pid}-0123abcd"
    other_host = tmp_path / f"fzero-some-other-host-{child.pid}-0123abcd"
    live = tmp_path / f"{prefix}-{os.getppid()}-0123abcd"
    not_ours = tmp_path / f"{prefix}-{child.pid}-notahexx"
    for d in (dead, other_host, live, not_ours):
        d.mkdir()
        (d / "swap").write_bytes(b"x")
    with ScratchDir(tmp_path) as scratch:
        assert not dead.exists()
        assert other_host.exists() and live.exists() and not_ours.exists()
        assert scratch.path.exists()
