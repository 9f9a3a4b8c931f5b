// The settings dialog: filled from the settings kept in this browser (store.js), read back
// when the user saves it.

const $ = (id) => document.getElementById(id);

// Fill the dialog from `s` ({system, temperature, maxTokens, markdown, apiKey}) and open it.
export function openSettingsDialog(s) {
  $("set-system").value = s.system;
  $("set-temperature").value = s.temperature ?? "";
  $("set-max-tokens").value = s.maxTokens ?? "";
  $("set-markdown").checked = s.markdown;
  $("set-api-key").value = s.apiKey;
  $("settings").returnValue = "";
  $("settings").showModal();
}

// The settings as the dialog holds them.
export function readSettingsDialog() {
  return { system: $("set-system").value, temperature: $("set-temperature").value,
           maxTokens: $("set-max-tokens").value, markdown: $("set-markdown").checked,
           apiKey: $("set-api-key").value };
}
