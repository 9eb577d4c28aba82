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

# `trace_start NAME` / `trace_stop`: with PROFILE=DIR, every exec and exit
# on the machine (sched tracepoints: next to no cost) until the stop, and
# DIR/NAME.txt: each program started, when (ms after the first), and how
# long it lived (to its exit, or "-" while it runs on).
trace_start() { # name
  [ -n "${PROFILE:-}" ] || return 0
  mkdir -p "$PROFILE"
  perf_name=$1
  perf record -q -a -e sched:sched_process_exec,sched:sched_process_exit -o "$PROFILE/$1.data" >/dev/null 2>&1 &
  perf_pid=$!
  sleep 0.3
}

trace_stop() {
  [ -n "$perf_pid" ] || return 0
  kill -INT "$perf_pid"
  wait "$perf_pid" 2>/dev/null || true
  perf_pid=
  {
    echo "== $perf_name: programs started (ms after the first), and how long each lived"
    perf script -i "$PROFILE/$perf_name.data" 2>/dev/null | awk '
      {
        t = $4; sub(":", "", t); t *= 1000
        if ($5 == "sched:sched_process_exec:") {
          f = $6; sub("filename=", "", f); p = $7; sub("pid=", "", p)
          if (f ~ /(bash|sleep|grep|sed|awk|cat|date|tail|perf|zattera-agent)$/) next
          if (t0 == "") t0 = t
          n++; at[n] = t; file[n] = f; pid[n] = p; open[p] = n
        } else if ($5 == "sched:sched_process_exit:") {
          p = $7; sub("pid=", "", p)
          if (p in open) { end[open[p]] = t; delete open[p] }
        }
      }
      END {
        for (i = 1; i <= n; i++)
          printf "   %8.1f  %8s  %s\n", at[i] - t0, (i in end) ? sprintf("%.1f", end[i] - at[i]) : "-", file[i]
      }'
  } >"$PROFILE/$perf_name.txt"
}
