// Copy buttons: <button class="copy" data-copy="#element-id"> copies that element's text. The clipboard API needs a
// secure context (https or localhost); elsewhere the text is selected and copied the old way.
document.addEventListener("click", async (event) => {
  const button = event.target.closest("button.copy[data-copy]");
  if (!button) return;
  const source = document.querySelector(button.dataset.copy);
  const text = source.textContent;
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const range = document.createRange();
    range.selectNodeContents(source);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    document.execCommand("copy");
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 2000);
});
