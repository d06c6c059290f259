#!/usr/bin/env bash
# Shrink the device machines' Ray bundle (../shared/device/make_ray_bundle.sh, ~46 MB) to ~37 MB
# by dropping what Ray Serve does not need here: py-spy, virtualenv (runtime_env pip) and the
# dashboard's web client. A device call carries at most 64 MiB: with the embedded model (24 MB)
# the checkout plus the whole bundle does not fit, the trimmed one does once bench/results/ is
# out of the working tree for the call (move it aside, move it back after).
#   bash bench/trim_ray_bundle.sh [devbundle/ray_bundle.tar.xz]
set -euo pipefail
bundle=${1:-devbundle/ray_bundle.tar.xz}
[ -f "$bundle" ] || { echo "no bundle at $bundle (make it with make_ray_bundle.sh)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xJf "$bundle" -C "$work"
rm -rf "$work"/site/bin/py-spy "$work"/site/py_spy-*.dist-info "$work"/site/bin/virtualenv \
  "$work"/site/virtualenv \
  "$work"/site/virtualenv-*.dist-info "$work"/site/ray/dashboard/client/build
before=$(stat -c %s "$bundle")
tar -C "$work" -cf - site | xz -T2 -9 > "$work/trimmed.tar.xz"
mv "$work/trimmed.tar.xz" "$bundle"
echo "$bundle: $((before / 1000000)) MB -> $(( $(stat -c %s "$bundle") / 1000000 )) MB"
