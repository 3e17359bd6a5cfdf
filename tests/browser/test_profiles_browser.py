"""An operator in a real browser: sign in to the real console process, open cpu-demo, make a child with another
context length through the htmx form (its every mistake reported at once, beside its field), and find it in the
profile list; a two-GPU profile's page says its attention mode, what the mode trades, and what this host lacks."""

from __future__ import annotations

from playwright.sync_api import expect

from tests.browser.conftest import ARTIFACTS, BROWSER, sign_in

pytestmark = BROWSER


def test_make_a_child_of_cpu_demo_in_the_browser(start_console, browser):
    # This test needs cpu-demo's "weights missing": no demo model installed.
    console_url = start_console(FLASHGATE_INSTALL_DEMO="0").url
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(10_000)
    page.goto(f"{console_url}/profiles")
    expect(page).to_have_url(f"{console_url}/signin?next=/profiles")
    sign_in(page)
    expect(page.get_by_role("heading", name="Profiles")).to_be_visible()
    expect(page.get_by_role("row", name="cpu-demo")).to_contain_text("weights missing")

    page.get_by_role("link", name="cpu-demo", exact=True).click()
    expect(page.get_by_role("heading", name="cpu-demo")).to_be_visible()
    # Qualify is off, and says what it needs.
    expect(page.get_by_role("button", name="Qualify")).to_be_disabled()
    expect(page.locator("#qualify-blocked")).to_contain_text("its checkpoint (config.json and *.safetensors) in ")
    expect(page.locator("#qualify-blocked")).to_contain_text("/demo")
    page.get_by_role("link", name="Make a child").click()

    # Settings are labelled in words, with their unit and what bounds them beside the field.
    context = page.get_by_label("Context length (tokens)")
    expect(context).to_have_value("4096")
    expect(page.locator(".field", has=context).locator(".hint")).to_contain_text("at most the model's maximum")
    expect(page.get_by_label("GPU memory share (fraction)")).to_be_visible()
    expect(page.get_by_label("Attention across GPUs")).to_have_value("data-parallel")
    expect(page.get_by_label("Which GPUs (GPU indices)")).to_have_value("")

    # Four mistakes at once, one of them not a number: every one shows beside its field, the form stays.
    page.get_by_label("Name").fill("cpu-demo")
    context.fill("999999999")
    page.get_by_label("Concurrent sequences (requests)").fill("lots")
    page.get_by_role("button", name="Create child").click()
    expect(page.locator("#error-name")).to_contain_text("a profile named 'cpu-demo' already exists")
    expect(page.locator("#error-rationale")).to_contain_text("rationale is required")
    expect(page.locator("#error-context_length")).to_contain_text("at most 1048576")
    expect(page.locator("#error-max_num_seqs")).to_contain_text("max_num_seqs must be a whole number, got 'lots'")
    expect(page.locator("#child-form .alert")).to_contain_text("fix the 4 fields marked below")
    page.screenshot(path=str(ARTIFACTS / "profiles-child-form-errors.png"), full_page=True)

    # Fixed but for one: only that error stays.
    page.get_by_label("Name").fill("cpu-demo-2k")
    page.get_by_label("Rationale").fill("Half the context: does the demo answer faster?")
    page.get_by_label("Concurrent sequences (requests)").fill("4")
    page.get_by_role("button", name="Create child").click()
    expect(page.locator("#child-form small.error")).to_have_count(1)
    expect(page.locator("#error-context_length")).to_be_visible()

    context.fill("2048")
    page.get_by_role("button", name="Create child").click()
    expect(page).to_have_url(f"{console_url}/profiles/cpu-demo-2k")
    expect(page.locator("table.diff")).to_contain_text("context_length")
    expect(page.locator("table.diff .after")).to_have_text("2048")
    page.screenshot(path=str(ARTIFACTS / "profiles-child-detail.png"), full_page=True)

    page.get_by_role("navigation", name="Main").get_by_role("link", name="Profiles").click()
    row = page.get_by_role("row", name="cpu-demo-2k")
    expect(row).to_contain_text("2,048")
    expect(row).to_contain_text("cpu-demo")
    page.screenshot(path=str(ARTIFACTS / "profiles-list.png"), full_page=True)

    page.get_by_role("link", name="flash-2gpu-dp-128k", exact=True).click()
    expect(page.locator("#profile-attention")).to_contain_text("data-parallel: each GPU holds a replica")
    expect(page.locator("#profile-attention")).to_contain_text("KV capacity is the sum over the GPUs")
    expect(page.locator("#profile-gpus")).to_contain_text("2, one engine process each: the first 2 the console sees")
    expect(page.locator("#qualify-blocked")).to_contain_text("2 GPUs with enough memory for its share of the weights")
    page.screenshot(path=str(ARTIFACTS / "profiles-two-gpus.png"), full_page=True)
