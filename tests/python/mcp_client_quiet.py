"""The official Python MCP client, which never declares `claude/channel`, drives `rsb mcp`
through a watched job's end and a cancelled background transfer (issue 40). Prints one JSON
object: every notification method the client received, and what the tool calls answered.
The server's command line comes from argv; its environment from this process's.
"""

import asyncio
import json
import os
import sys

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

received = []
errors = []


async def on_message(message):
    # Requests, notifications and exceptions all come here; only their kinds are kept.
    if isinstance(message, Exception):
        errors.append(repr(message))
        return
    root = getattr(message, "root", message)
    method = getattr(root, "method", None)
    if method is not None:
        received.append(method)


async def call(session, tool, args):
    r = await session.call_tool(tool, args)
    text = r.content[0].text if r.content else ""
    if getattr(r, "is_error", None) or getattr(r, "isError", False):
        raise SystemExit(f"{tool}({args}) failed: {text}")
    return json.loads(text) if text.startswith("{") else text


async def main():
    proj = sys.argv[1]
    params = StdioServerParameters(command=sys.argv[2], args=sys.argv[3:], env=dict(os.environ))
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write, message_handler=on_message) as session:
            await session.initialize()
            job = await call(
                session,
                "exec_bash_background",
                {"command": "echo quiet; exit 3", "session_name": "py-quiet",
                 "interval_s": 1, "notify_local": False},
            )
            # The job ends; the watch records it; nothing may be pushed to this client.
            for _ in range(100):
                status = await call(session, "check_background_task",
                                    {"tmux_session": "py-quiet", "wait_s": 5})
                if not status.get("running"):
                    break
            watch_id = job.get("watch_id", 0)
            for _ in range(200):
                w = await call(session, "get_background_watch", {"watch_id": watch_id})
                if '"completed"' in json.dumps(w):
                    break
                await asyncio.sleep(0.1)
            task = await call(session, "sync_local_to_remote",
                              {"local_path": proj, "remote_path": "py-quiet-proj"})
            task_id = task["task_id"]
            await session.call_tool("cancel_file_transfer_task", {"task_id": task_id})
            for _ in range(200):
                t = await call(session, "check_file_transfer_task", {"task_id": task_id})
                if t.get("status") in ("completed", "cancelled", "failed", "interrupted"):
                    break
                await asyncio.sleep(0.1)
            # Several of the pusher's ticks, then close while anything late would arrive.
            await asyncio.sleep(2)
    print(json.dumps({"received": received, "errors": errors,
                      "job": job, "transfer_status": t.get("status")}))


asyncio.run(main())
