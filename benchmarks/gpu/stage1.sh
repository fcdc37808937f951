#!/usr/bin/env bash
# First GPU call: park the first half of the target GGUF on the machine.
set -e
mkdir -p /root/m && cp .carry/c0/* /root/m/ && ls -la /root/m
# the benchmark's prepared dataset, when carried (.carry/train/regen: see README.md here)
if [ -d .carry/train/regen ]; then mkdir -p /root/data && cp -r .carry/train/regen /root/data/; fi
