#!/usr/bin/env bash
# Stage what a GPU run needs from beside the checkout, before calling the device tool:
#   bash tools/stage_device.sh
# The device tool sends the checkout only (../shared stays behind), so the TensorRT headers the
# plugin and its host test build against (NVIDIA's open-source headers at
# ../shared/third_party/tensorrt/include) are copied into .device/tensorrt/include: ignored by git
# (/.device/ in .gitignore: NVIDIA's files are never committed), sent with the device tool's
# carry: [".device"]. tools/gpu_check.sh uses .device/tensorrt as TensorRT_ROOT when that is unset.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${TENSORRT_HEADERS:-../shared/third_party/tensorrt/include}
[ -f "$src/NvInfer.h" ] || { echo "stage_device: no TensorRT headers at $src (set TENSORRT_HEADERS)" >&2; exit 2; }
git check-ignore -q .device/x || { echo "stage_device: .device/ is not ignored by git; refusing to copy NVIDIA's headers" >&2; exit 2; }
rm -rf .device/tensorrt
mkdir -p .device/tensorrt
cp -r "$src" .device/tensorrt/include
echo "staged $(du -sh .device/tensorrt | cut -f1) of TensorRT headers in .device/tensorrt (carry: [\".device\"])"
