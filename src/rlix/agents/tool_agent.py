"""The generic tool-calling agent: ask the policy, run the tools it calls, repeat, then verify.

Each turn sends the whole conversation, with the resources server's tools, to the policy's
chat-completions endpoint (header X-Session-ID: the episode's session), and appends the answer
exactly as it came (the policy gateway stitches turns only onto the conversation it answered).
No sampling parameters are sent: the pipeline's gateway applies its own, so the behaviour
logprobs are those the trainer assumes. A reply that calls tools gets each tool's output as a
`tool` message; a tool the model names wrongly or calls with bad arguments gets the error as its
output (the model's mistake, not the environment's). A reply without calls is passed to
`feedback_tool` when one is configured, its answer becoming the next user turn (not after the
last turn: nobody would read it, and the verifier reads the reply itself); otherwise it ends the
episode. A reply cut at max tokens (finish_reason "length") is a turn like any other. A 400 from
the policy (the conversation no longer fits, say) ends the episode too; what was done so far is
verified. Any other policy failure fails the episode (a 502 the pipeline retries).
"""

from __future__ import annotations

import json
from typing import Any

from rlix.agents.protocol import RunRequest, RunResult
from rlix.agents.sdk import AgentServer, ResourcesError
from rlix.errors import AgentEnvError

#: resources answers that are the model's mistake (unknown tool, bad arguments): shown to it
_MODEL_ERRORS = (404, 422)


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
            if reply is None:  # refused (400): the episode ends here
                break
            turns += 1
            messages.append(reply)
            if reply.get("tool_calls"):
                for call in reply["tool_calls"]:
                    calls += 1
                    output = await self._tool(req, call)
                    call_id = call.get("id", "") if isinstance(call, dict) else ""
                    messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            elif cfg.feedback_tool and turns < cfg.max_turns:
                calls += 1
                output = await resources.call(cfg.feedback_tool, req.episode_id,
                                              {"answer": _text(reply.get("content"))}, req.example)
                messages.append({"role": "user", "content": output})
            else:  # no feedback tool, or the last turn (the verifier reads it)
                break
        verdict = await resources.verify(req.episode_id, req.example, messages)
        return RunResult(episode_id=req.episode_id, reward=verdict.reward, turns=turns, tool_calls=calls,
                         messages=messages)

    async def _policy(self, req: RunRequest, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The policy's assistant message, as it came; None when it refused the request (400)."""
        status, content = await self.chat(req, {"model": req.policy.model, "messages": messages,
                                                **({"tools": tools} if tools else {})})
        if status == 400:
            return None
        if status != 200:
            raise AgentEnvError(f"policy answered {status}: {_start(content)}")
        try:
            message = json.loads(content)["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            message = None
        if not isinstance(message, dict):
            raise AgentEnvError(f"policy answer is not a chat completion: {_start(content)}")
        return message

    async def _tool(self, req: RunRequest, call: Any) -> str:
        """One tool call's output; the model's own mistakes come back to it as the output."""
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not name or not isinstance(name, str):
            return "error: a tool call must name a function"
        raw = fn.get("arguments") or "{}"  # type: ignore[union-attr]
        try:
            args = raw if isinstance(raw, dict) else json.loads(raw)
        except (json.JSONDecodeError, TypeError):
            return f"error: the arguments of {name} are not JSON"
        if not isinstance(args, dict):
            return f"error: the arguments of {name} must be a JSON object"
        try:
            return await self.resources.call(name, req.episode_id, args, req.example)
        except ResourcesError as exc:
            if exc.status in _MODEL_ERRORS:
                return f"error: {exc.detail}"
            raise


def _text(content: Any) -> str:
    """An assistant message's text: a string, or the text parts of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _start(content: bytes) -> str:
    """An answer's first 200 bytes on one line (for an error message)."""
    return " ".join(content[:200].decode(errors="replace").split())
