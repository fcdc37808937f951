#!/usr/bin/env bash
# First GPU call: park the first half of the target GGUF on the machine.
set -e
mkdir -p /root/m && cp .carry/c0/* /root/m/ && ls -la /root/m
