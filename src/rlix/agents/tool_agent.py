"""The generic tool-calling agent: ask the policy, run the tools it calls, repeat, then verify.

Each turn sends the whole conversation, with the resources server's tools, to the policy's
chat-completions endpoint (header X-Session-ID: the episode's session), and appends the answer
exactly as it came (the policy gateway stitches turns only onto the conversation it answered).
A reply that calls tools gets each tool's output as a `tool` message; a tool the model names
wrongly or calls with bad arguments gets the error as its output (the model's mistake, not the
environment's). A reply without calls is passed to `feedback_tool` when one is configured, its
answer becoming the next user turn (not after the last turn: the verifier reads that one);
otherwise it ends the episode. A 400 from the policy (the
conversation no longer fits, say) ends the episode too; what was done so far is verified.
"""

from __future__ import annotations

import json
from typing import Any

from rlix.agents.protocol import RunRequest, RunResult
from rlix.agents.sdk import AgentServer
from rlix.errors import AgentEnvError


class ToolAgent(AgentServer):
    async def run(self, req: RunRequest) -> RunResult:
        cfg, resources = self.config, self.resources
        tools = [t.model_dump() for t in (await resources.tools()).tools] if cfg.show_tools else []
        messages: list[dict[str, Any]] = []
        if cfg.system_prompt:
            messages.append({"role": "system", "content": cfg.system_prompt})
        messages.append({"role": "user", "content": req.example.prompt})
        turns = calls = 0
        while turns < cfg.max_turns:
            reply = await self._policy(req, messages, tools)
            if reply is None:  # refused: the episode ends here
                break
            turns += 1
            messages.append(reply)
            if reply.get("tool_calls"):
                for call in reply["tool_calls"]:
                    calls += 1
                    output = await self._tool(req, call)
                    messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": output})
            elif cfg.feedback_tool and turns < cfg.max_turns:
                calls += 1
                output = await resources.call(cfg.feedback_tool, req.episode_id,
                                              {"answer": reply.get("content") or ""}, req.example)
                messages.append({"role": "user", "content": output})
            else:  # no feedback tool, or the last turn (the verifier reads it)
                break
        verdict = await resources.verify(req.episode_id, req.example, messages)
        return RunResult(episode_id=req.episode_id, reward=verdict.reward, turns=turns, tool_calls=calls,
                         messages=messages)

    async def _policy(self, req: RunRequest, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]]) -> dict[str, Any] | None:
        policy = req.policy
        resp = await self.http.post(
            f"{policy.base_url.rstrip('/')}/v1/chat/completions",
            json={"model": policy.model, "messages": messages, **({"tools": tools} if tools else {})},
            headers={"X-Session-ID": req.session_id, "Authorization": f"Bearer {policy.api_key}"})
        if resp.status_code == 400:
            return None
        if resp.status_code != 200:
            raise AgentEnvError(f"policy answered {resp.status_code}: {resp.text[:200]}")
        try:
            message = resp.json()["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise AgentEnvError(f"policy answer is not a chat completion: {resp.text[:200]}") from None
        return dict(message)

    async def _tool(self, req: RunRequest, call: dict[str, Any]) -> str:
        fn = call.get("function") or {}
        name = fn.get("name", "")
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            return f"error: the arguments of {name} are not JSON"
        if not isinstance(args, dict):
            return f"error: the arguments of {name} must be an object"
        try:
            return await self.resources.call(name, req.episode_id, args, req.example)
        except AgentEnvError as exc:
            if " answered 404" in str(exc) or " answered 422" in str(exc):
                return f"error: {exc}"  # the model called a tool wrongly: it hears why
            raise
