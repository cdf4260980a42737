import json
import shutil
import time
import urllib.request

base_url = "http://localhost:30000"
video_id = "REPLACE_WITH_RETURNED_ID"
deadline = time.monotonic() + 1800

while time.monotonic() < deadline:
    with urllib.request.urlopen(f"{base_url}/v1/videos/{video_id}", timeout=30) as response:
        job = json.load(response)
    if job["status"] == "failed":
        raise RuntimeError(job)
    if job["status"] == "completed":
        with urllib.request.urlopen(
            f"{base_url}/v1/videos/{video_id}/content", timeout=120
        ) as response, open("output.mp4", "wb") as output:
            shutil.copyfileobj(response, output)
        break
    time.sleep(2)
else:
    raise TimeoutError("Video generation did not finish within 30 minutes")
