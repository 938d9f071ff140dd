"""Lanes that compose both sides in one process: plain target decode (the oracle, `plain`)
and the local lane (draft and target together, `local`); `result` is what every lane
returns."""
