# Whole-machine CPU profiles for the benchmarks (sourced). With PROFILE=DIR
# set, `profile_start NAME` runs `perf record -a -e cpu-clock` (every
# process and the kernel, sampled at 997 Hz; a software clock, so it needs
# no hardware counters) until `profile_stop`, which writes DIR/NAME.data and
# DIR/NAME.txt: the samples (1 ms of CPU each) by class of process, then by
# command and binary. Without PROFILE both do nothing.

perf_pid=
perf_name=
profile_start() { # name
  [ -n "${PROFILE:-}" ] || return 0
  mkdir -p "$PROFILE"
  perf_name=$1
  perf record -q -a -g -e cpu-clock -F 997 -o "$PROFILE/$1.data" >/dev/null 2>&1 &
  perf_pid=$!
  sleep 0.3 # sampling before the clock starts; that idle counts in
}

profile_stop() {
  [ -n "$perf_pid" ] || return 0
  kill -INT "$perf_pid"
  wait "$perf_pid" 2>/dev/null || true
  perf_pid=
  local d="$PROFILE/$perf_name.data"
  {
    echo "== $perf_name: CPU samples (1 ms each) by class of process"
    perf report -i "$d" --no-children -g none -n --sort comm --stdio 2>/dev/null | grep -v '^#' | awk '
      NF >= 3 {
        c = $3; n = $2
        if (c == "swapper") k = "idle (with ~0.3 s before the clock)"
        else if (c ~ /^runc/ || c == "exe") k = "runc (create, start, init)"
        else if (c ~ /^containerd-shim/) k = "runc shims"
        else if (c == "containerd") k = "containerd"
        else if (c ~ /^(tokio-rt-worker|zattera-agent|zt-unshare|zt-netns|nft)$/) k = "agent (with its netns helper, nft)"
        else if (c ~ /^zattera-log/) k = "log shims"
        else if (c ~ /^(ctr|bridge|host-local|loopback)$/) k = "ctr and CNI plugins"
        else if (c ~ /^(docker-registr|registry)/) k = "registry"
        else if (c ~ /^(kworker|ksoftirqd|rcu|migration|jbd2)/) k = "kernel threads"
        else k = "other (the bench: bash, status polls, sleep)"
        s[k] += n; t += n
      }
      END { for (k in s) printf "   %6d  %5.1f%%  %s\n", s[k], 100 * s[k] / t, k }' | sort -rn
    echo "== by command and binary"
    perf report -i "$d" --no-children -g none -n --sort comm,dso --stdio 2>/dev/null | grep -v '^#' | grep -v '^$' | head -40
  } >"$PROFILE/$perf_name.txt"
}
