#!/usr/bin/env python3
"""Writes the pull benchmark's image as an OCI archive (one image, linux/amd64):
the rig's busybox layer, re-tarred with a nonce file so that no other
containerd namespace can already hold it, then LAYERS layers of LAYER_MIB MiB
of random (incompressible) data each, gzip-compressed like registry images.

usage: mkbig.py BUSYBOX_OCI_TAR OUT_TAR [LAYERS] [LAYER_MIB]
"""

import gzip
import hashlib
import io
import json
import os
import sys
import tarfile

OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def digest(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def read_blob(tf, dig):
    return tf.extractfile("blobs/sha256/" + dig.split(":", 1)[1]).read()


def tar_bytes(add):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        add(t)
    return buf.getvalue()


def add_file(t, name, data, mode=0o644):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    info.mtime = 0
    t.addfile(info, io.BytesIO(data))


def layer(raw_tar):
    """(blob, diff_id) of a gzip layer; level 1: the data does not compress anyway."""
    return gzip.compress(raw_tar, compresslevel=1, mtime=0), digest(raw_tar)


def main():
    src, out = sys.argv[1], sys.argv[2]
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    mib = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    nonce = os.urandom(16).hex()

    with tarfile.open(src) as tf:
        index = json.loads(tf.extractfile("index.json").read())
        manifest = json.loads(read_blob(tf, index["manifests"][0]["digest"]))
        config = json.loads(read_blob(tf, manifest["config"]["digest"]))
        base = gzip.decompress(read_blob(tf, manifest["layers"][0]["digest"]))

    def base_plus_nonce(t):
        with tarfile.open(fileobj=io.BytesIO(base)) as b:
            for m in b.getmembers():
                t.addfile(m, b.extractfile(m) if m.isreg() else None)
        add_file(t, "etc/zt-bench-nonce", nonce.encode() + b"\n")

    layers = [layer(tar_bytes(base_plus_nonce))]
    for i in range(count):
        data = os.urandom(mib * 1024 * 1024)
        layers.append(layer(tar_bytes(lambda t, i=i, d=data: add_file(t, f"data/layer{i}.bin", d))))

    config["rootfs"] = {"type": "layers", "diff_ids": [d for _, d in layers]}
    config["history"] = [{"created_by": f"bench/runtime/mkbig.py layer {i}"} for i in range(len(layers))]
    config_blob = json.dumps(config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": digest(config_blob),
            "size": len(config_blob),
        },
        "layers": [{"mediaType": OCI_LAYER, "digest": digest(b), "size": len(b)} for b, _ in layers],
    }
    manifest_blob = json.dumps(manifest, sort_keys=True).encode()
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": manifest["mediaType"],
                "digest": digest(manifest_blob),
                "size": len(manifest_blob),
                "annotations": {"org.opencontainers.image.ref.name": "big"},
            }
        ],
    }

    blobs = [config_blob, manifest_blob] + [b for b, _ in layers]
    with tarfile.open(out, "w") as t:
        add_file(t, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add_file(t, "index.json", json.dumps(index).encode())
        for b in blobs:
            add_file(t, "blobs/sha256/" + digest(b).split(":", 1)[1], b)
    total = sum(len(b) for b, _ in layers)
    print(f"{out}: {len(layers)} layers, {total / 1048576:.1f} MiB compressed, manifest {digest(manifest_blob)}")


if __name__ == "__main__":
    main()
