"""Multi-turn agent environments over HTTP (NeMo Gym style), and the pipeline's side of them.

protocol.py (what the servers send each other), sdk.py (writing an environment: ResourcesServer,
AgentServer, tool), tool_agent.py (the generic tool-calling agent), envs/ (shipped environments),
serve.py (`python -m rlix.agents.serve`), supervisor.py (their processes, supervised by a Ray
actor), gateway.py + gateway_app.py (the policy endpoint agents call: token-exact turns),
episodes.py (an episode's turns -> one training sample), rollout.py (one trajectory = one
episode), environment.py (all of it for one pipeline).
"""
