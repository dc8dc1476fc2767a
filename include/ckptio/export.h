// Which symbols the ckptio libraries export. They are built with hidden
// visibility: only what a public header marks CKPTIO_EXPORT is part of a
// library's interface; everything else stays inside it.
#ifndef CKPTIO_EXPORT_H_
#define CKPTIO_EXPORT_H_

#define CKPTIO_EXPORT [[gnu::visibility("default")]]

// Internal helpers this source tree's own tools and tests call (declared in
// headers under src/ and plugins/, never installed): exported so they link,
// but not part of the API and free to change.
#define CKPTIO_EXPORT_PRIVATE [[gnu::visibility("default")]]

#endif  // CKPTIO_EXPORT_H_
