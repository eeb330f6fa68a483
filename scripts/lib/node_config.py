"""Writes a crab.toml for a second node on this machine: the config crabctl prints
(`crabctl config --json`, on stdin) with the node's own directories and the registry.

Usage: crabctl config --json | python3 node_config.py DIR REGISTRY_PREFIX > node.toml
DIR holds the node's store, kept images, runc root and crabd socket; the registry is
plain HTTP (a local registry of scripts/registry)."""
import json
import sys


def toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        # JSON's string escapes are TOML basic-string escapes.
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise ValueError(f"no TOML form for {value!r}")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    directory, prefix = sys.argv[1], sys.argv[2]
    config = json.load(sys.stdin)
    config["runtime"]["root"] = f"{directory}/runc"
    config["checkpoint"]["state_dir"] = f"{directory}/store"
    config["checkpoint"]["kept_images_dir"] = f"{directory}/kept-images"
    config["node"]["socket"] = f"{directory}/crabd/crabd.sock"
    config["remote"].update(prefix=prefix, plain_http=True)
    for section, keys in config.items():
        print(f"[{section}]")
        for key, value in keys.items():
            print(f"{key} = {toml_value(value)}")
        print()


if __name__ == "__main__":
    main()
