"""The peers: the same turnaround and fan-out scenarios on Temporal and Prefect.

``runner`` (project venv) installs each peer in its own virtualenv
(``bench/.venv-<peer>``), runs its script there with a time limit in its own process
group, reads the JSON it writes, and kills the group afterwards. The peer scripts
(``temporal_peer.py``, ``prefect_peer.py``) import nothing from this project.
"""
