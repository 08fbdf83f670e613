"""The reward of examples/math_dataset: `reward(response, row)` sees the whole row, here its
`answer` and its `tolerance` (the rows' extra field: divisions are right to two decimals).

1.0 for the first number of the response within `tolerance` of the answer, 0.2 for any other
number (partial credit: GRPO learns from differences within a group), 0 for none.
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def reward(response: str, row: dict) -> float:
    found = NUMBER.search(response)
    if found is None:
        return 0.0
    return 1.0 if abs(float(found.group()) - float(row["answer"])) <= float(row["tolerance"]) else 0.2
