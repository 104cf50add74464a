"""A flipped, truncated or missing byte anywhere is a miss with a reason, never bytes;
``sparkcache verify`` exits 1 and names the file and the entries it breaks."""

import os
import random
import shutil

import pytest

from store_helpers import IDENT, all_store_files, conv_keys, conv_pages, open_store, run_cli


@pytest.fixture
def pristine(tmp_path):
    root = tmp_path / "pristine"
    store = open_store(root, page_blocks=4)
    for conv, n in ((1, 10), (2, 7)):
        assert store.publish(IDENT, conv_keys(conv, n), conv_pages(conv, n, 4)).ok
    return root


def _copy(pristine, tmp_path, name):
    dest = tmp_path / name
    shutil.copytree(pristine, dest)
    return dest


def _owner_conv(store, path):
    """Which conversation a file belongs to."""
    for conv, n in ((1, 10), (2, 7)):
        lookup = store.lookup(IDENT, conv_keys(conv, n))
        if lookup.hit and (os.path.basename(path).startswith(lookup.entry_id)
                           or any(p.digest[2:] == os.path.basename(path) for p in lookup.handle.pages)):
            return conv, n
    raise AssertionError(f"{path} belongs to no entry")


def test_flip_one_byte_in_every_file(pristine, tmp_path):
    rng = random.Random(7)
    files = all_store_files(open_store(pristine, page_blocks=4))
    assert len(files) == 7  # 3 + 2 page objects, 2 manifests
    for i, original in enumerate(files):
        rel = os.path.relpath(original, pristine)
        size = os.path.getsize(original)
        for offset in sorted({0, size - 1, rng.randrange(size)}):
            root = _copy(pristine, tmp_path, f"flip{i}-{offset}")
            conv, n = _owner_conv(open_store(pristine, page_blocks=4), original)
            path = os.path.join(root, rel)
            with open(path, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0x01]))
            store = open_store(root, page_blocks=4)
            lookup, read = store.fetch(IDENT, conv_keys(conv, n))
            reason = read.reason if lookup.hit else lookup.reason
            assert reason == "corrupt", (rel, offset, lookup, read)
            assert read is None or not read.pages
            if "/manifests/" not in path:  # the cheap lookup passes; verified lookup refuses
                assert store.lookup(IDENT, conv_keys(conv, n), verify=True).reason == "corrupt"
                read = store.read(lookup.handle)  # the restore's path
                assert read.reason == "corrupt" and not read.pages
            cli = run_cli("verify", "--root", str(root))
            assert cli.returncode == 1, cli.stdout + cli.stderr
            assert path in cli.stdout and "BAD corrupt" in cli.stdout
            # the other conversation is unaffected
            other = 2 if conv == 1 else 1
            _, other_read = store.fetch(IDENT, conv_keys(other, 10 if other == 1 else 7))
            assert other_read is not None and other_read.ok


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_truncated_or_deleted_object_is_absent(pristine, tmp_path, damage):
    root = _copy(pristine, tmp_path, damage)
    store = open_store(root, page_blocks=4)
    lookup = store.lookup(IDENT, conv_keys(1, 10))
    victim = store.objects.path(lookup.handle.pages[1].digest)
    if damage == "truncate":
        os.truncate(victim, lookup.handle.pages[1].size // 2)
    else:
        os.unlink(victim)
    result = open_store(root, page_blocks=4).lookup(IDENT, conv_keys(1, 10))
    assert not result.hit and result.reason == "absent" and victim.split("/")[-1] in result.detail
    # a reader holding the handle from before the damage also gets a miss, not bytes
    read = store.read(lookup.handle)
    assert read.reason == "absent" and read.pages == ()
    cli = run_cli("verify", "--root", str(root))
    assert cli.returncode == 1 and victim in cli.stdout and lookup.entry_id in cli.stdout


def test_truncated_manifest_is_corrupt(pristine, tmp_path):
    root = _copy(pristine, tmp_path, "trunc-manifest")
    store = open_store(root, page_blocks=4)
    entry = store.entry(store.lookup(IDENT, conv_keys(2, 7)).entry_id)
    os.truncate(entry.path, entry.manifest_bytes - 5)
    result = open_store(root, page_blocks=4).lookup(IDENT, conv_keys(2, 7))
    assert result.reason == "corrupt" and not result.hit
    assert run_cli("verify", "--root", str(root)).returncode == 1


def test_manifest_of_another_format_is_a_miss_that_names_the_fix(pristine, tmp_path):
    """A well-formed manifest of format 1 (sha256 page names) is refused as corrupt, and
    ``verify`` says which format this sparkcache reads and what to do."""
    import hashlib
    import json

    from sparkcache.store.manifests import MAGIC
    root = _copy(pristine, tmp_path, "format1")
    store = open_store(root, page_blocks=4)
    entry = store.entry(store.lookup(IDENT, conv_keys(2, 7)).entry_id)
    with open(entry.path, "rb") as f:
        body = json.loads(f.read().split(b"\n", 1)[1])
    body["format"] = 1
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    with open(entry.path, "wb") as f:
        f.write(MAGIC + hashlib.sha256(raw).hexdigest().encode() + b"\n" + raw)
    assert open_store(root, page_blocks=4).lookup(IDENT, conv_keys(2, 7)).reason == "corrupt"
    cli = run_cli("verify", "--root", str(root))
    assert cli.returncode == 1 and entry.path in cli.stdout
    assert "reads format 2" in cli.stdout and "SPARKCACHE_NAMESPACE" in cli.stdout, cli.stdout


def test_verify_passes_on_pristine_store(pristine):
    cli = run_cli("verify", "--root", str(pristine))
    assert cli.returncode == 0, cli.stdout
    assert "problems=0 -> ok" in cli.stdout


def _first_page(store):
    handle = store.lookup(IDENT, conv_keys(1, 10)).handle
    ref = handle.pages[0]
    return ref, store.objects.path(ref.digest)


def test_a_corrupt_object_is_discarded_and_the_next_publication_heals_the_entry(pristine, tmp_path):
    root = _copy(pristine, tmp_path, "heal")
    store = open_store(root, page_blocks=4)
    ref, path = _first_page(store)
    data = bytearray(open(path, "rb").read())
    data[3] ^= 0x10
    open(path, "wb").write(bytes(data))
    assert store.lookup(IDENT, conv_keys(1, 10), verify=True).reason == "corrupt"
    # the name is taken: a publication of the same bytes would not rewrite it
    assert store.publish(IDENT, conv_keys(1, 10), conv_pages(1, 10, 4)).ok
    assert store.lookup(IDENT, conv_keys(1, 10), verify=True).reason == "corrupt"
    assert store.objects.discard_corrupt(ref.digest, ref.size)
    assert not os.path.exists(path)
    assert store.lookup(IDENT, conv_keys(1, 10)).reason == "absent"  # not offered meanwhile
    assert store.publish(IDENT, conv_keys(1, 10), conv_pages(1, 10, 4)).ok
    lookup, read = store.fetch(IDENT, conv_keys(1, 10))
    assert lookup.hit and read.ok and list(read.pages) == conv_pages(1, 10, 4)


def test_discard_keeps_good_objects_and_never_follows_a_link_out(pristine, tmp_path):
    root = _copy(pristine, tmp_path, "keep")
    store = open_store(root, page_blocks=4)
    ref, path = _first_page(store)
    assert not store.objects.discard_corrupt(ref.digest, ref.size)  # it verifies: stays
    assert os.path.exists(path)
    outside = tmp_path / "outside"
    outside.write_bytes(open(path, "rb").read())
    os.unlink(path)
    os.symlink(outside, path)  # a link in place of the object: removed, its target untouched
    assert store.objects.discard_corrupt(ref.digest, ref.size)
    assert not os.path.lexists(path) and outside.read_bytes() == conv_pages(1, 10, 4)[0]
    os.mkdir(path)  # a directory in place of the object: not ours to remove
    assert not store.objects.discard_corrupt(ref.digest, ref.size) and os.path.isdir(path)


def test_discard_never_removes_through_a_linked_shard_directory(pristine, tmp_path):
    root = _copy(pristine, tmp_path, "shard")
    store = open_store(root, page_blocks=4)
    ref, path = _first_page(store)
    shard = os.path.dirname(path)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(shard, elsewhere)
    os.symlink(elsewhere, shard)
    victim = elsewhere / os.path.basename(path)
    victim.write_bytes(b"x" * ref.size)  # wrong bytes, outside the root
    assert not store.objects.discard_corrupt(ref.digest, ref.size)
    assert victim.read_bytes() == b"x" * ref.size
