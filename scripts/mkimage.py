#!/usr/bin/env python3
"""Build a tiny busybox image from Debian's busybox-static, with no network.

Writes, into OUT_DIR:
  busybox-oci.tar     an OCI image layout archive (index.json, blobs/sha256/...)
  busybox-docker.tar  the same image as a legacy `docker save` archive
  busybox-multi-oci.tar, busybox-user-oci.tar   a two-platform index; User: app
  tools-oci.tar       busybox plus /bin/ztprobe (scripts/testbin/ztprobe.c,
                      built static by the rig; path in $ZTPROBE), for the
                      security tests' hostile container
  symlink-oci.tar     busybox plus a layer whose /data and /srv are symlinks
                      onto host paths (/var/lib/zattera-rig/host-secret,
                      /var/lib/zattera-rig): a hostile image for copy-up
  volume-oci.tar      busybox plus /data/seed.txt under an image VOLUME /data

The output is byte-for-byte reproducible (fixed mtimes and ordering), so the
image digest is stable across runs and machines with the same busybox build.
Usage: mkimage.py OUT_DIR [REF]
"""
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

BUSYBOX = "/bin/busybox"
MTIME = 0


def add_file(tar, name, data, mode=0o644):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    info.mtime = MTIME
    tar.addfile(info, io.BytesIO(data))


def add_dir(tar, name, mode=0o755):
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = mode
    info.mtime = MTIME
    tar.addfile(info)


def add_link(tar, name, target):
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    info.mtime = MTIME
    tar.addfile(info)


def tar_layer(entries):
    """A layer from (kind, name, payload) entries: file, dir or link."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for kind, name, payload in entries:
            {"file": lambda: add_file(tar, name, payload, 0o755),
             "dir": lambda: add_dir(tar, name),
             "link": lambda: add_link(tar, name, payload)}[kind]()
    return buf.getvalue()


def single_image(out_dir, file_name, ref, base_config, base_layers, extra_layer, config_extra=None):
    """An OCI archive of `ref`: the base layers plus one more; `config_extra`
    is merged into the image config's `config`."""
    layers = list(base_layers) + [extra_layer]
    gzs = [gzip.compress(l, compresslevel=6, mtime=MTIME) for l in layers]
    cfg = json.loads(base_config)
    cfg["config"] = {**cfg.get("config", {}), **(config_extra or {})}
    cfg["rootfs"] = {"type": "layers", "diff_ids": [sha(l) for l in layers]}
    config = canonical(cfg)
    manifest = canonical({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": sha(g), "size": len(g)} for g in gzs],
    })
    index = canonical({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": sha(manifest),
            "size": len(manifest),
            "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[-1]},
        }],
    })
    path = os.path.join(out_dir, file_name)
    write_oci(path, index, tuple([config, manifest] + gzs))
    print(f"{path}: {ref}")


def rootfs_layer():
    applets = subprocess.run([BUSYBOX, "--list"], check=True, capture_output=True, text=True).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("bin", "etc", "tmp", "root", "var", "var/www", "proc", "sys", "dev"):
            add_dir(tar, d, 0o1777 if d == "tmp" else 0o755)
        with open(BUSYBOX, "rb") as f:
            add_file(tar, "bin/busybox", f.read(), 0o755)
        for applet in sorted(set(applets)):
            if applet != "busybox":
                add_link(tar, f"bin/{applet}", "busybox")
        add_file(tar, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\napp:x:1000:1000:app:/:/bin/sh\n")
        add_file(tar, "etc/group", b"root:x:0:\nnogroup:x:65534:\napp:x:1000:\nwww:x:33:app\n")
        add_file(tar, "var/www/index.html", b"hello from zattera\n")
    return buf.getvalue()


def sha(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_oci(path, index, blobs):
    """An OCI image layout archive, written whole then renamed into place."""
    with tarfile.open(path + ".tmp", "w", format=tarfile.PAX_FORMAT) as tar:
        add_file(tar, "oci-layout", canonical({"imageLayoutVersion": "1.0.0"}))
        add_file(tar, "index.json", index)
        add_dir(tar, "blobs")
        add_dir(tar, "blobs/sha256")
        for blob in blobs:
            add_file(tar, "blobs/sha256/" + sha(blob).split(":")[1], blob)
    os.replace(path + ".tmp", path)


def build(out_dir, ref):
    layer = rootfs_layer()
    diff_id = sha(layer)
    gz = gzip.compress(layer, compresslevel=6, mtime=MTIME)
    config = canonical({
        "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine),
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "Cmd": ["sh"],
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "zattera scripts/mkimage.py from Debian busybox-static"}],
    })
    manifest = canonical({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": sha(gz), "size": len(gz)}],
    })
    index = canonical({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": sha(manifest),
            "size": len(manifest),
            "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[-1]},
        }],
    })
    os.makedirs(out_dir, exist_ok=True)
    oci_path = os.path.join(out_dir, "busybox-oci.tar")
    write_oci(oci_path, index, (config, manifest, gz))

    # Legacy `docker save`: uncompressed layer tar, config named by its hex digest.
    config_hex = sha(config).split(":")[1]
    layer_dir = hashlib.sha256(layer).hexdigest()
    docker_manifest = canonical([{"Config": config_hex + ".json", "RepoTags": [ref.removeprefix("docker.io/library/")], "Layers": [layer_dir + "/layer.tar"]}])
    docker_path = os.path.join(out_dir, "busybox-docker.tar")
    with tarfile.open(docker_path + ".tmp", "w", format=tarfile.PAX_FORMAT) as tar:
        add_file(tar, config_hex + ".json", config)
        add_dir(tar, layer_dir)
        add_file(tar, layer_dir + "/VERSION", b"1.0")
        add_file(tar, layer_dir + "/layer.tar", layer)
        add_file(tar, "manifest.json", docker_manifest)
    os.replace(docker_path + ".tmp", docker_path)
    # Two platforms in one index: this host's, and one it is not, sharing the layer.
    host_arch = json.loads(config)["architecture"]
    other_arch = "s390x" if host_arch != "s390x" else "amd64"
    other_config = canonical({**json.loads(config), "architecture": other_arch})
    other_manifest = canonical({**json.loads(manifest), "config": {
        "mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(other_config), "size": len(other_config)}})
    multi_index = canonical({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha(other_manifest),
             "size": len(other_manifest), "platform": {"os": "linux", "architecture": other_arch}},
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha(manifest),
             "size": len(manifest), "platform": {"os": "linux", "architecture": host_arch}},
        ],
    })
    outer = canonical({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.index.v1+json", "digest": sha(multi_index),
                       "size": len(multi_index), "annotations": {"org.opencontainers.image.ref.name": "multi"}}],
    })
    multi_path = os.path.join(out_dir, "busybox-multi-oci.tar")
    write_oci(multi_path, outer, (config, manifest, other_config, other_manifest, multi_index, gz))
    # The same rootfs with `User: app`: a named user resolved from the
    # image's /etc/passwd and /etc/group.
    user_ref = ref.rsplit(":", 1)[0] + ":user"
    user_config = canonical({**json.loads(config), "config": {**json.loads(config)["config"], "User": "app"}})
    user_manifest = canonical({**json.loads(manifest), "config": {
        "mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(user_config), "size": len(user_config)}})
    user_index = canonical({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": sha(user_manifest),
            "size": len(user_manifest),
            "annotations": {"io.containerd.image.name": user_ref, "org.opencontainers.image.ref.name": "user"},
        }],
    })
    user_path = os.path.join(out_dir, "busybox-user-oci.tar")
    write_oci(user_path, user_index, (user_config, user_manifest, gz))
    repo = ref.rsplit(":", 1)[0]
    probe = os.environ.get("ZTPROBE")
    if probe:
        with open(probe, "rb") as f:
            single_image(out_dir, "tools-oci.tar", repo + ":tools", config, [layer],
                         tar_layer([("file", "bin/ztprobe", f.read())]))
    single_image(out_dir, "symlink-oci.tar", repo + ":symlink", config, [layer],
                 tar_layer([("link", "data", "/var/lib/zattera-rig/host-secret"),
                            ("link", "srv", "/var/lib/zattera-rig")]))
    # An image VOLUME entry with content under it (Docker makes an
    # anonymous volume of it, filled from the image).
    single_image(out_dir, "volume-oci.tar", repo + ":volume", config, [layer],
                 tar_layer([("dir", "data", None), ("file", "data/seed.txt", b"from the image\n")]),
                 {"Volumes": {"/data": {}}})
    print(f"{oci_path}: {ref} manifest {sha(manifest)}")
    print(f"{user_path}: {user_ref}")
    print(f"{docker_path}: {ref}")
    print(f"{multi_path}: index {sha(multi_index)} ({host_arch}, {other_arch})")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    build(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "docker.io/zattera/busybox:test")
