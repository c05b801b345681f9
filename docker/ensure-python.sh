#!/bin/sh
# Make sure the base image has Python >= 3.11 with venv, and the unprivileged user the services run as.
# CUDA (Ubuntu) bases ship without Python; slim Python images and a debootstrap Debian root have it.
set -eu
if ! python3 -c 'import sys, venv, ensurepip; assert sys.version_info >= (3, 11)' 2>/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends python3 python3-venv ca-certificates
  rm -rf /var/lib/apt/lists/*
fi
python3 -c 'import sys; assert sys.version_info >= (3, 11), sys.version'
getent group 10001 >/dev/null || groupadd -g 10001 minicpmo
getent passwd 10001 >/dev/null || useradd -u 10001 -g 10001 -d /home/minicpmo -m -s /usr/sbin/nologin minicpmo
mkdir -p /models /opt/minicpmo/docker /opt/minicpmo/configs
