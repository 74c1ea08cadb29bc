#!/usr/bin/env bash
# Put this checkout itself on VENV's path, after `pip install -e .` there:
#  - a script run from the folder that holds the clone (named mxfs by git clone) would
#    otherwise import the clone's root as a namespace package, not the editable install;
#  - with the checkout on the path, setuptools' import hook for the editable install is
#    not needed, and it cost every Python process 23 ms at start (pathlib, re, urllib):
#    the test suite starts some thousands of them.  Its .pth is emptied, not removed, so
#    that pip still uninstalls cleanly.
#   usage: tools/checkout_path.sh VENV
set -euo pipefail
site=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pwd > "$site/mxfs-checkout.pth"
for hook in "$site"/__editable__.mxfs-*.pth; do
  if [ -e "$hook" ]; then : > "$hook"; fi
done
