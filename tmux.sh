#!/usr/bin/env bash
# One tmux session with a pane per process log of an `rl` run: uv run rl ... in the first pane, logs below.
#   ./tmux.sh [output_dir] [session_name]      (output_dir must match the run's output_dir)
set -euo pipefail
out="${1:-outputs}"
session="${2:-prime-rl}"
mkdir -p "$out/logs"
if tmux has-session -t "$session" 2>/dev/null; then
  exec tmux attach -t "$session"
fi
tmux new-session -d -s "$session" -n rl
tmux set-option -t "$session" pane-border-status top
tmux select-pane -t "$session:rl.0" -T "rl (run uv run rl @ ... here)"
for name in orchestrator trainer inference; do
  tmux split-window -v -t "$session:rl" "tail -F '$out/logs/$name.log'"
  tmux select-pane -T "$name"
done
tmux select-layout -t "$session:rl" even-vertical
tmux select-pane -t "$session:rl.0"
exec tmux attach -t "$session"
