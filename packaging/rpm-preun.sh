if [ "$1" -eq 0 ]; then
  # Removal, not upgrade: the agent stops; its containers keep running.
  if [ -d /run/systemd/system ]; then
    systemctl --no-reload disable --now zattera-agent.service >/dev/null 2>&1 || :
  else
    systemctl --no-reload disable zattera-agent.service >/dev/null 2>&1 || :
  fi
fi
