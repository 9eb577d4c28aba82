install -d -m 0700 /var/lib/zattera
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload >/dev/null 2>&1 || :
fi
if [ "$1" -eq 1 ]; then
  # First install: enabled, not started (configure it first).
  systemctl enable zattera-agent.service >/dev/null 2>&1 || :
fi
