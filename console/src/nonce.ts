// The page's Content-Security-Policy allows inline <style> elements only with the nonce the
// daemon put in this answer (cpuosd.console.routes). The terminal's renderer makes a few
// <style> elements of its own; every one made on this page gets the nonce. Imported first.
const nonce = document.querySelector<HTMLMetaElement>('meta[name="cpuos-style-nonce"]')?.content ?? ""

if (nonce && !nonce.startsWith("__")) {
  const create = Document.prototype.createElement
  Document.prototype.createElement = function (this: Document, tag: string, opts?: ElementCreationOptions) {
    const el = create.call(this, tag, opts)
    if (tag.toLowerCase() === "style") (el as HTMLStyleElement).nonce = nonce
    return el
  } as typeof Document.prototype.createElement
}

export {}
