#!/usr/bin/env python3
"""Writes a single-layer OCI image layout as a tar archive, for `ctr image import`.

The layer is an uncompressed rootfs tar made by the caller; its sha256 is both
the blob digest and the diff_id. Output is deterministic for a given layer and
configuration, so the same inputs always give the same manifest digest.
"""

import argparse
import hashlib
import io
import json
import os
import sys
import tarfile

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"


def sha256_of_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_json(value):
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def add_bytes(archive, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    archive.addfile(info, io.BytesIO(data))


def blob_name(hex_digest):
    return f"blobs/sha256/{hex_digest}"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layer", required=True, help="uncompressed rootfs tar")
    parser.add_argument("--output", required=True, help="OCI layout tar to write")
    parser.add_argument("--name", required=True, help="image reference, e.g. crab.local/busybox:latest")
    parser.add_argument("--cmd", required=True, help="JSON array for the config's Cmd")
    parser.add_argument("--workdir", default="/")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE, repeatable")
    parser.add_argument("--label", action="append", default=[], help="KEY=VALUE, repeatable")
    args = parser.parse_args()

    cmd = json.loads(args.cmd)
    if not isinstance(cmd, list) or not all(isinstance(part, str) for part in cmd):
        sys.exit(f"oci_image.py: --cmd must be a JSON array of strings, got {args.cmd!r}")
    for item in args.env + args.label:
        if "=" not in item:
            sys.exit(f"oci_image.py: expected KEY=VALUE, got {item!r}")

    layer_hex = sha256_of_file(args.layer)
    layer_size = os.path.getsize(args.layer)

    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": args.env,
            "Cmd": cmd,
            "WorkingDir": args.workdir,
            "Labels": dict(item.split("=", 1) for item in args.label),
        },
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_hex}"]},
        "history": [{"created_by": f"crab scripts/build-images {args.name}"}],
    }
    config_bytes = canonical_json(config)
    config_hex = hashlib.sha256(config_bytes).hexdigest()

    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": f"sha256:{config_hex}", "size": len(config_bytes)},
        "layers": [{"mediaType": LAYER_MEDIA_TYPE, "digest": f"sha256:{layer_hex}", "size": layer_size}],
    }
    manifest_bytes = canonical_json(manifest)
    manifest_hex = hashlib.sha256(manifest_bytes).hexdigest()

    tag = args.name.rsplit(":", 1)[1] if ":" in args.name.rsplit("/", 1)[-1] else "latest"
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": [
            {
                "mediaType": MANIFEST_MEDIA_TYPE,
                "digest": f"sha256:{manifest_hex}",
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                # containerd's importer takes the full name from its own
                # annotation; the OCI one carries the tag for other tools.
                "annotations": {
                    "io.containerd.image.name": args.name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }
        ],
    }

    partial = args.output + ".partial"
    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as archive:
        add_bytes(archive, "oci-layout", canonical_json({"imageLayoutVersion": "1.0.0"}))
        add_bytes(archive, "index.json", canonical_json(index))
        add_bytes(archive, blob_name(manifest_hex), manifest_bytes)
        add_bytes(archive, blob_name(config_hex), config_bytes)
        layer_info = tarfile.TarInfo(blob_name(layer_hex))
        layer_info.size = layer_size
        layer_info.mode = 0o644
        with open(args.layer, "rb") as layer:
            archive.addfile(layer_info, layer)
    os.replace(partial, args.output)
    print(f"sha256:{manifest_hex}")


if __name__ == "__main__":
    main()
