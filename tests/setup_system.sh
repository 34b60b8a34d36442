#!/usr/bin/env bash
# System packages the test suite uses beyond pip: an OpenSSH server for the multi-host tests
# (tests/netns.py starts one sshd per network namespace) and iproute2 for the namespaces.
# Best effort: without them those tests fall back (ip netns exec) or skip with the reason.
set -uo pipefail
if [ "$(id -u)" != 0 ]; then
    echo "setup_system: not root; the multi-host tests will skip"; exit 0
fi
want=()
[ -x /usr/sbin/sshd ] || want+=(openssh-server)
command -v ssh >/dev/null || want+=(openssh-client)
command -v ip >/dev/null || want+=(iproute2)
if [ ${#want[@]} -gt 0 ] && command -v apt-get >/dev/null; then
    echo "setup_system: installing ${want[*]}"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${want[@]}"; } \
        >/tmp/hora-setup-system.log 2>&1 \
        || echo "setup_system: apt-get failed (see /tmp/hora-setup-system.log)"
fi
exit 0
