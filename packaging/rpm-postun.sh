if [ -d /run/systemd/system ]; then
  systemctl daemon-reload >/dev/null 2>&1 || :
  if [ "$1" -ge 1 ]; then
    # Upgrade: restart the agent on the new binary; containers are untouched.
    systemctl try-restart zattera-agent.service >/dev/null 2>&1 || :
  fi
fi
