"""Screenshot the web page after a short chat: docs/img/web.png.

Two questions are answered, a third is streaming when the picture is taken
(once the KV panel shows the bytes it holds and counts the first two).

python scripts/web_screenshot.py [--url http://127.0.0.1:8080] [--out docs/img/web.png]

Needs a running server (`mlx-kvq serve`, the demo model), Chromium and
chromedriver (Debian: apt-get install chromium chromium-driver) and selenium.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

MESSAGES = ("And God said", "What did Moses say unto the LORD?", "And the king said")
DONE = "li.assistant[data-done=true]"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--out", default=str(Path(__file__).parents[1] / "docs/img/web.png"))
    parser.add_argument("--size", default="1440,960", help="window width,height")
    parser.add_argument("--max-tokens", default="80")
    args = parser.parse_args()

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for flag in (*FLAGS, f"--window-size={args.size}"):
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="kvq-screenshot-")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        wait = WebDriverWait(driver, 300, poll_frequency=0.1)
        driver.get(args.url + "/")
        driver.execute_script("localStorage.clear()")
        driver.get(args.url + "/")
        wait.until(lambda d: d.find_element("id", "state").get_attribute("data-state") == "ready")
        tokens = driver.find_element("id", "max-tokens")
        tokens.clear()
        tokens.send_keys(args.max_tokens, Keys.TAB)
        for n, message in enumerate(MESSAGES, start=1):
            driver.find_element("id", "input").send_keys(message, Keys.ENTER)
            if n < len(MESSAGES):
                wait.until(lambda d, n=n: len(d.find_elements("css selector", DONE)) == n)
        wait.until(lambda d: d.find_element("id", "stat-requests").text.startswith("2 ok"))
        wait.until(lambda d: d.find_element("id", "kv-total").text not in ("-", "0 B"))
        driver.execute_script("document.activeElement.blur()")
        driver.save_screenshot(args.out)
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
