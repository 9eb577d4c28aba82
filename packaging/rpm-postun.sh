if [ -d /run/systemd/system ]; then
  systemctl daemon-reload >/dev/null 2>&1 || :
  if [ "$1" -ge 1 ]; then
    # Upgrade: restart the agent on the new binary; containers are untouched.
    systemctl try-restart zattera-agent.service >/dev/null 2>&1 || :
  fi
fi
if [ "$1" -eq 0 ]; then
  # Erase: build scratch (beside /var/lib/zattera, transient) goes; the data
  # dir stays (volumes and identity).
  rm -rf /var/lib/zattera-build
fi
